"""MoE in the FSDP backend: --moe-kernel (fused vs eager) and routing replay (R3)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from miles_core.args import ArgumentError
from miles_fsdp.adaptations.moe import resolve_moe_kernel
from moe_programs import moe_kernel_program
from safetensors import safe_open
from samples import make_samples
from spawn import run_ranks
from tiny_models import arch_config, save_tiny_model

pytestmark = pytest.mark.numeric


def test_moe_kernel_resolution():
    assert resolve_moe_kernel(None, "qwen3_moe", "cuda") == "fused"
    assert resolve_moe_kernel(None, "qwen3_moe", "cpu") == "eager"
    assert resolve_moe_kernel("fused", "qwen3_5_moe", "cpu") == "fused"
    assert resolve_moe_kernel("eager", "glm4_moe_lite", "cuda") == "eager"
    assert resolve_moe_kernel(None, "qwen3", "cuda") is None
    with pytest.raises(ArgumentError, match="--moe-kernel fused: model_type 'qwen3'"):
        resolve_moe_kernel("fused", "qwen3", "cuda")


@pytest.mark.slow  # a fresh interpreter importing triton
def test_fused_on_cpu_without_interpreter_is_refused():
    code = (
        "from miles_core.args import ArgumentError\n"
        "from miles_fsdp.adaptations.moe import apply_moe_kernel\n"
        "try:\n"
        "    apply_moe_kernel(None, 'fused', 'cpu')\n"
        "except ArgumentError as err:\n"
        "    print(err)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert "set TRITON_INTERPRET=1" in out.stdout, out.stderr


def moe_samples(n: int, seed: int = 11):
    """Short samples: the fused kernels run under Triton's interpreter (tests/gpu uses it too)."""
    return make_samples(n, seed, short=True)


@pytest.mark.slow
def test_fused_experts_train_like_eager_and_publish_per_expert(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the spawned ranks run the kernels on the CPU
    config = arch_config("qwen3_moe")
    config.num_hidden_layers = 1  # the interpreter runs each kernel block in Python
    hf_dir = save_tiny_model(tmp_path / "qwen3_moe", config)
    out = tmp_path / "out.pt"
    run_ranks(1, moe_kernel_program, str(hf_dir), moe_samples(4), str(out), timeout=300)
    got = torch.load(out, weights_only=True)
    assert got["eager"]["impl"] == "eager" and got["fused"]["impl"] == "miles_fused"
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        on_disk = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert got["fused"]["published"] == on_disk  # per-expert names and shapes
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        start = f.get_tensor("model.layers.0.mlp.experts.1.down_proj.weight")
    eager, fused = got["eager"]["params"], got["fused"]["params"]
    assert not torch.equal(eager["model.layers.0.mlp.experts.down_proj"][1], start)  # trained
    assert got["fused"]["pg_loss"] == pytest.approx(got["eager"]["pg_loss"], rel=1e-5, abs=1e-7)
    for name, value in eager.items():
        torch.testing.assert_close(fused[name], value, rtol=1e-5, atol=1e-6, msg=name)


# Routing replay (R3): test_routing_replay_engine.py (built-in engine end to end) and
# test_glm_routing_replay.py (the glm4_moe_lite router).
