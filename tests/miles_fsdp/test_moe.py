"""MoE in the FSDP backend: --moe-kernel (fused vs eager) and routing replay (R3)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from miles_core.args import ArgumentError
from miles_fsdp.adaptations.moe import resolve_moe_kernel
from moe_programs import moe_kernel_program
from moe_reference import reference_log_probs
from run_args import make_args
from safetensors import safe_open
from spawn import run_ranks
from tiny_models import arch_config, save_tiny_model


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
    from miles_core.batch import Sample

    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        prompt, response = 3 + i % 2, 3 + i % 3
        samples.append(
            Sample(
                tokens=torch.randint(0, 64, (prompt + response,), generator=g),
                response_length=response,
                reward=float(torch.rand((), generator=g)),
                group_index=i // 2,
            )
        )
    return samples


@pytest.mark.slow
def test_fused_experts_train_like_eager_and_publish_per_expert(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the spawned ranks run the kernels on the CPU
    config = arch_config("qwen3_moe")
    config.num_hidden_layers = 1  # the interpreter runs each kernel block in Python
    hf_dir = save_tiny_model(tmp_path / "qwen3_moe", config)
    out = tmp_path / "out.pt"
    run_ranks(1, moe_kernel_program, str(hf_dir), moe_samples(4), str(out), timeout=300)
    got = torch.load(out, weights_only=False)
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


# --------------------------------------------------------------------------- routing replay


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    init = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.slow
def test_routing_replay_follows_the_engine_and_keeps_router_gradient(one_rank_group, tmp_path):
    from miles_core.batch import RolloutBatch, Sample
    from miles_core.log_probs import token_log_probs
    from miles_core.packing import pack_thd
    from miles_fsdp.backend import FSDPBackend
    from miles_fsdp.rollout_train import RolloutContext, packed_logits
    from torch.distributed.tensor import DTensor

    config = arch_config("qwen3_moe")
    config.norm_topk_prob = True
    config.initializer_range = 0.3  # experts and router matter in the output
    hf_dir = str(save_tiny_model(tmp_path / "m", config))
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (12,), generator=g)
    # the "engine's" choice: random distinct experts per token and layer (not the router's)
    routed = (
        torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(12 * 2)])
        .reshape(12, 2, 2)
        .to(torch.int32)
    )
    sample = Sample(tokens=tokens, response_length=6, reward=1.0, routed_experts=routed)
    ref_logp, ref_model = reference_log_probs(hf_dir, tokens, routed)
    ref_logp.sum().backward()

    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=hf_dir, use_rollout_routing_replay=True))
    ctx = RolloutContext(
        model=backend.model,
        optimizer=backend.optimizer,
        scheduler=backend.scheduler,
        args=backend.args,
        device=backend.device,
        dp_size=1,
        cpu_group=None,
        attn_implementation=backend.attn_implementation,
        compute_dtype=backend.precision.compute_dtype,
        routing_replay=backend.routing_replay,
    )
    packed = pack_thd(RolloutBatch([sample]))
    assert packed.routed_experts is not None
    logp = token_log_probs(packed_logits(ctx, packed), packed.targets, 1.0)[0, :11]
    torch.testing.assert_close(logp.double(), ref_logp, rtol=0, atol=1e-5)
    logp.sum().backward()
    for layer in range(2):
        grad = backend.model.model.layers[layer].mlp.gate.weight.grad
        grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
        want = ref_model.model.layers[layer].mlp.gate.weight.grad
        assert want.abs().max() > 0
        torch.testing.assert_close(grad.double(), want, rtol=1e-4, atol=1e-6)

    # without replay the trainer routes by its own top-k, which is not the engine's choice
    ctx.routing_replay = None
    backend.routing_replay.set(None)  # the patched routers fall back to their own top-k
    with torch.no_grad():
        own = token_log_probs(packed_logits(ctx, packed), packed.targets, 1.0)[0, :11]
    assert (own.double() - ref_logp).abs().max() > 1e-3

    ctx.routing_replay = backend.routing_replay
    bare = pack_thd(RolloutBatch([Sample(tokens=tokens, response_length=6, reward=1.0)]))
    with pytest.raises(ValueError, match="samples carry no routed_experts"):
        packed_logits(ctx, bare)
    backend.close()
