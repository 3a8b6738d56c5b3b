"""``--use-rollout-routing-replay`` on the Megatron backend: the actor's log-prob pass over a
THD-packed micro-batch routes every token to the samples' ``routed_experts`` (megatron-core's
``RouterReplay``), equal to the float64 HF model forced to the same experts
(tests/miles_fsdp/moe_reference.py); and the layouts it does not cover are refused at argument
time. One training forward/backward of the sum of those log-probs, every layer recomputed in the
backward (the ids held through it), gives the routers' gradients of the float64 reference.

The forced experts are the complement of what the HF router picks on its own (4 experts, top 2):
layer 0 sees the same hidden states either way, so every token's forced pair there differs from
the router's; the natural-routing log-probs are asserted to be far from the forced ones, so a
trainer that ignored the replay would fail.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from dist_ranks import spawn_ranks
from megatron_ranks import layout_argv, parse
from megatron_tiny_models import make_tiny_hf
from miles_core.args import ArgumentError
from miles_core.batch import Sample
from routing_replay_ranks import replayed_log_probs
from tolerances import FP32_EPS, assert_within, grad_atol

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "miles_fsdp"))
from moe_reference import reference_log_probs  # noqa: E402

#: fp32 log-probs of a 2-layer model (64-wide matmuls, a log-softmax over 96 tokens) of
#: magnitude ~5 against float64: a few hundred roundings of 2^-24 relative (~1e-4)
ATOL = 256 * FP32_EPS * 8


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """The tiny Qwen3-MoE, two samples with forced experts, and their float64 references."""
    from transformers import AutoModelForCausalLM

    hf_dir = str(make_tiny_hf("qwen3_moe", tmp_path_factory.mktemp("hf") / "qwen3_moe"))
    model = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager"
    )
    gen = torch.Generator().manual_seed(5)
    samples, refs, router_grads = [], [], {}
    for length, response in ((9, 4), (13, 5)):
        tokens = torch.randint(0, 96, (length,), generator=gen)
        with torch.no_grad():
            out = model(input_ids=tokens[None], output_router_logits=True)
        natural_logp = torch.log_softmax(out.logits[0], -1)[:-1].gather(-1, tokens[1:, None])[:, 0]
        # per layer [T, 4]: the two experts the router does NOT pick, ascending
        forced = torch.stack(
            [logits.argsort(-1)[:, :2].sort(-1).values for logits in out.router_logits], dim=1
        ).to(torch.int32)
        natural0 = out.router_logits[0].topk(2, -1).indices
        assert not (forced[:, 0, :, None] == natural0[:, None, :]).any()  # disjoint at layer 0
        ref, ref_model = reference_log_probs(hf_dir, tokens, forced)
        ref[-response:].sum().backward()
        for layer, block in enumerate(ref_model.model.layers):
            router_grads[layer] = router_grads.get(layer, 0) + block.mlp.gate.weight.grad
        assert (ref - natural_logp).abs().max() > 100 * ATOL  # replay matters here
        samples.append(
            Sample(tokens=tokens, response_length=response, reward=1.0, routed_experts=forced)
        )
        refs.append(ref.detach()[-response:])
    return hf_dir, samples, refs, router_grads


def _check(results: list[dict], refs: list[torch.Tensor], router_grads: dict) -> None:
    for result in results:
        assert result["layer_calls"] == 4  # both layers recomputed in the backward
        assert result["router_grads"].keys() == router_grads.keys()
        for layer, want in router_grads.items():
            got = torch.tensor(result["router_grads"][layer], dtype=torch.float64)
            assert_within(got, want, grad_atol(want), f"router gradient of layer {layer}")
        assert result["replayed"] == [2, 2]  # log-prob pass, train step: both MoE layers each
        assert result["cleared"]
        for got, want in zip(result["log_probs"], refs, strict=True):
            torch.testing.assert_close(
                torch.tensor(got, dtype=torch.float64), want, rtol=0, atol=ATOL
            )


@pytest.mark.extended  # ~21 s on a 2-core host (6 s the float64 reference, 15 s the rank)
@pytest.mark.numeric
def test_replayed_log_probs_equal_forced_hf_ep1(case):
    hf_dir, samples, refs, grads = case
    results = spawn_ranks(replayed_log_probs, 1, hf_dir, layout_argv(), samples, timeout=300)
    _check(results, refs, grads)


@pytest.mark.extended
@pytest.mark.numeric
def test_replayed_log_probs_equal_forced_hf_ep2(case):
    """EP 2: the experts split over the ranks, tokens dispatched all-to-all."""
    hf_dir, samples, refs, grads = case
    results = spawn_ranks(replayed_log_probs, 2, hf_dir, layout_argv(ep=2), samples, timeout=300)
    _check(results, refs, grads)


@pytest.mark.parametrize(
    ("layout", "named"),
    [
        (["--context-parallel-size", "2"], "--context-parallel-size 2"),
        (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size 2"),
        (layout_argv(tp=2), "--sequence-parallel"),
    ],
)
def test_refused_layouts(layout, named):
    with pytest.raises(ArgumentError, match=f"--use-rollout-routing-replay with {named}"):
        parse([*layout, "--use-rollout-routing-replay"])
