"""LoRA on the megatron backend against the FSDP backend's PEFT model and dense oracles.

* logits and every adapter gradient equal the FSDP backend's PEFT model (miles_fsdp.lora on
  the HF model) built from the same base and PEFT directory, at TP=1 and TP=2 (+SP), 1e-5 fp32;
* expert linears (qwen3_moe, EP=2) equal a plain model with merged ``W + s B A`` weights, and
  adapter gradients equal the chain rule through the merged weight;
* the backend: adapters only in DDP/optimizer, base bit-identical after training, lora_base
  reference log-probs equal the HF base, sleep/wake copies the base once, adapter-only
  checkpoint resumes at TP=1, exported PEFT directory loads in PEFT and the FSDP backend,
  merged publish equals ``W + (alpha/r) B A`` bit-exactly (fp32 and a bf16 checkpoint);
* flag errors and target matching (fast, no ranks); PEFT directories themselves are
  tested in tests/miles_core/test_peft_adapter.py.

The multi-rank checks share one spawn of 2 gloo ranks (the module fixture ``rank_runs``): the
ranks import megatron once and run every program in sequence; each test asserts on its program's
result, so each still names one behaviour and fails on its own program's error.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_ranks import spawn_ranks
from lora_ranks import fsdp_lora_model, inputs, peft_adapter
from megatron_ranks import parse
from megatron_tiny_models import make_tiny_hf
from miles_core.args import ArgumentError
from miles_megatron.lora.layers import is_targeted

FLOW_TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]  # partly fused: k/up stay zero


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return str(make_tiny_hf("qwen3", tmp_path_factory.mktemp("hf") / "qwen3"))


@dataclass
class FsdpReference:
    """The FSDP backend's PEFT model on an all-linear adapter: logits and adapter gradients of
    ``sum(logits * weights)`` on :func:`lora_ranks.inputs`."""

    adapter_dir: Path
    logits: torch.Tensor
    grads: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def fsdp_reference(qwen3, tmp_path_factory) -> FsdpReference:
    adapter_dir = peft_adapter(
        qwen3, tmp_path_factory.mktemp("all_linear") / "adapter", "all-linear"
    )
    ids, weights = inputs()
    model = fsdp_lora_model(qwen3, adapter_dir)
    logits = model(input_ids=ids).logits
    (logits * weights).sum().backward()
    grads = {
        n.replace(".default.weight", ""): p.grad.detach().clone()
        for n, p in model.named_parameters()
        if "lora_" in n
    }
    return FsdpReference(adapter_dir, logits.detach(), grads)


@dataclass
class FlowDirs:
    """Directories of the backend flow: the PEFT adapter it starts from, checkpoint, export."""

    adapter: Path
    save: Path
    export: Path


@pytest.fixture(scope="module")
def flow_dirs(qwen3, tmp_path_factory) -> FlowDirs:
    root = tmp_path_factory.mktemp("flow")
    return FlowDirs(
        peft_adapter(qwen3, root / "adapter", FLOW_TARGETS), root / "save", root / "export"
    )


@pytest.fixture(scope="module")
def bf16_dir(qwen3, tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("bf16") / "qwen3"
    AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.bfloat16).save_pretrained(out)
    return out


@dataclass
class RankRuns:
    """Every rank's ``{label: run}`` from :func:`lora_ranks.run_programs`."""

    per_rank: list[dict[str, dict[str, Any]]]

    def __call__(self, label: str) -> list[Any]:
        """The per-rank results of program ``label``; fails the test if a rank raised in it."""
        runs = [r[label] for r in self.per_rank]
        for rank, run in enumerate(runs):
            if not run["ok"]:
                pytest.fail(f"rank {rank} raised in {label}:\n{run['error']}", pytrace=False)
        return [run["value"] for run in runs]


@pytest.fixture(scope="module")
def rank_runs(qwen3, fsdp_reference, flow_dirs, bf16_dir, tmp_path_factory) -> RankRuns:
    """All multi-rank programs of this module in ONE spawn of 2 gloo ranks (each rank imports
    megatron once, ~20-30 s on a CI core), run in sequence; the tests below assert on them."""
    from lora_ranks import (
        backend_lora_flow,
        experts_match_merged_oracle,
        logits_and_grads_match,
        merged_publish_bf16,
        run_programs,
    )

    moe = str(make_tiny_hf("qwen3_moe", tmp_path_factory.mktemp("moe") / "qwen3_moe"))
    ids, weights = inputs()
    ref = fsdp_reference
    programs = [
        ("fsdp_peft", logits_and_grads_match,
         (qwen3, str(ref.adapter_dir), ids, weights, ref.logits, ref.grads, [2, 1])),
        ("experts", experts_match_merged_oracle, (moe, ids, weights)),
        ("publish_bf16", merged_publish_bf16, (str(bf16_dir), 2)),
        ("backend_flow", backend_lora_flow,
         (qwen3, str(flow_dirs.adapter), str(flow_dirs.save), str(flow_dirs.export))),
    ]  # fmt: skip
    return RankRuns(spawn_ranks(run_programs, 2, programs, timeout=1200))


@pytest.mark.slow
def test_logits_and_grads_equal_fsdp_peft_at_tp1_and_tp2(fsdp_reference, rank_runs):
    assert len(fsdp_reference.grads) == 2 * 7 * 2  # 2 layers x 7 linears x (A, B)
    for per_tp in rank_runs("fsdp_peft"):
        assert per_tp[1]["fresh"] == per_tp[2]["fresh"]  # same draw at any layout
        for pair in per_tp[1]["fresh"].values():
            assert torch.tensor(pair["lora_A"]).abs().sum() > 0
            assert not torch.tensor(pair["lora_B"]).any()
        for tp, r in per_tp.items():
            assert r["logits"] < 1e-5, (tp, r["logits"])
            assert r["extra"] == [] and r["frozen_grads"] == []
            for key, diff in r["grads"].items():
                assert diff <= 1e-5 * max(1.0, r["grad_scale"][key]), (tp, key, diff)


@pytest.mark.slow
def test_expert_adapters_equal_merged_weight_oracle_at_ep2(rank_runs):
    for r in rank_runs("experts"):
        assert r["logits"] < 1e-5 * r["logits_scale"]
        assert r["expert_modules"] == 2 * 2 * 3  # 2 layers x 2 local experts x gate/up/down
        assert max(r["grads"].values()) < 1e-5


@pytest.mark.slow
def test_backend_lora_train_sleep_save_resume_export(qwen3, flow_dirs, rank_runs):
    from lora_ranks import check_lora_flow

    check_lora_flow(rank_runs("backend_flow")[0], qwen3, flow_dirs.export, FLOW_TARGETS)


@pytest.mark.slow
def test_merged_publish_is_bit_exact_in_bf16(bf16_dir, rank_runs):
    from safetensors.torch import load_file

    base = load_file(str(bf16_dir / "model.safetensors"))
    r = rank_runs("publish_bf16")[0]
    assert len(r["factors"]) == 2 * 7
    changed = 0
    for name, w in base.items():
        assert w.dtype == torch.bfloat16
        dtype, values = r["merged"][name]
        got = torch.tensor(values).to(torch.bfloat16)
        assert dtype == "torch.bfloat16"
        pair = r["factors"].get(name.removesuffix(".weight"))
        if pair is None:
            assert torch.equal(got, w), name
            continue
        a = torch.tensor(pair["lora_A"][1]).to(torch.bfloat16)
        b = torch.tensor(pair["lora_B"][1]).to(torch.bfloat16)
        assert pair["lora_A"][0] == pair["lora_B"][0] == "torch.bfloat16"
        want = (w.float() + r["scale"] * (b.float() @ a.float())).to(torch.bfloat16)
        assert torch.equal(got, want), name
        changed += not torch.equal(want, w)
    assert changed == 2 * 7


# ---------------------------------------------------------------- fast: flags and targets


def test_publish_lora_adapter_requires_use_lora(tmp_path):
    with pytest.raises(ArgumentError, match="--publish-lora-adapter requires --use-lora"):
        parse(["--publish-lora-adapter"])
    # the frozen base comes from --hf-checkpoint: refused at argument time without one
    with pytest.raises(ArgumentError, match="--use-lora needs --hf-checkpoint"):
        parse(["--publish-lora-adapter", "--use-lora"])
    from megatron_tiny_models import hf_config

    hf_config("qwen3", False).save_pretrained(tmp_path)  # the parser reads the architecture
    argv = ["--publish-lora-adapter", "--use-lora", "--hf-checkpoint", str(tmp_path)]
    assert parse(argv).publish_lora_adapter


@pytest.mark.parametrize(
    "targets",
    [["q_proj", "v_proj"], ["self_attn.o_proj"], ["proj"], r".*layers\.1\..*_proj", ["mlp"]],
)
def test_target_matching_is_peft_matching(targets):
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    config = LoraConfig(target_modules=targets)
    for layer in range(2):
        for module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.up_proj"):
            name = f"model.layers.{layer}.{module}"
            mine = is_targeted(name, targets if isinstance(targets, str) else tuple(targets))
            assert mine == bool(check_target_module_exists(config, name)), (targets, name)
