"""FSDP gradients equal a plain single-process HF model's, for any layout and micro-batch split."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rank_programs import gradients_program, layout_gradients, layouts_gradients_program
from spawn import run_ranks
from tiny_models import save_tiny_model

TOL = 2e-5


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("qwen3")))


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 64, (8, 12), generator=g)


def reference_grads(hf_dir, data) -> dict[str, torch.Tensor]:
    """d/dw of sum(token NLL) / token count over the whole batch, plain HF model in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    logits = model(input_ids=data).logits[:, :-1]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1))
    loss.backward()
    return {n: p.grad.detach() for n, p in model.named_parameters()}


def assert_grads_match(got, ref, world):
    for split, result in got.items():
        assert set(result["grads"]) == set(ref)
        for name, grad in result["grads"].items():
            torch.testing.assert_close(
                grad, ref[name], atol=TOL, rtol=0, msg=f"{name}, {world} ranks, {split} micro"
            )


def check(hf_dir, data, tmp_path, world, dp_replicate, splits):
    out = tmp_path / f"grads_{world}_{dp_replicate}.pt"
    run_ranks(world, gradients_program, hf_dir, data, dp_replicate, splits, str(out), timeout=300)
    got = torch.load(out)
    assert_grads_match(got, reference_grads(hf_dir, data), world)


@pytest.mark.slow
def test_one_rank_one_vs_four_micro_batches(one_rank_group, hf_dir, data):
    """World 1 runs in the test process (no spawn)."""
    got = layout_gradients(0, 1, hf_dir, data, dp_replicate=1, micro_splits=(1, 4))
    assert_grads_match(got, reference_grads(hf_dir, data), world=1)
    assert got[1]["loss"] == pytest.approx(got[4]["loss"], rel=1e-6)


@pytest.mark.slow
def test_two_ranks_dp_shard(hf_dir, data, tmp_path):
    check(hf_dir, data, tmp_path, world=2, dp_replicate=1, splits=(2,))


@pytest.mark.slow
def test_four_ranks_dp_shard_and_hybrid_2x2(hf_dir, data, tmp_path):
    """One spawn of 4 ranks, a fresh backend per layout: 4 shards (one micro-batch), and
    HSDP with 2 replicas x 2 shards (two micro-batches)."""
    out = tmp_path / "grads_4.pt"
    layouts = {1: (1,), 2: (2,)}
    run_ranks(4, layouts_gradients_program, hf_dir, data, layouts, str(out), timeout=300)
    got = torch.load(out)
    assert set(got) == set(layouts)
    ref = reference_grads(hf_dir, data)
    for dp_replicate, splits in layouts.items():
        assert set(got[dp_replicate]) == set(splits)
        assert_grads_match(got[dp_replicate], ref, world=4)
