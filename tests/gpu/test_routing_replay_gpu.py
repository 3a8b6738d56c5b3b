"""Routing replay (R3) at Qwen3-30B-A3B's MoE shape on a GPU, bf16, the trainer on the fused
kernels: the CPU suite's R3 test (tests/miles_fsdp/test_routing_replay_engine.py) at real sizes.

A 2-layer qwen3_moe with the MoE shape of Qwen3-30B-A3B (128 experts, top-8, hidden 2048,
expert intermediate 768, 32 heads of 128, 4 KV heads; vocabulary 256) is served in bf16 by the
built-in engine on the GPU (``--enable-return-routed-experts``), which samples one response and
returns its log-probs and routed experts. The FSDP trainer (bf16 compute, ``--moe-kernel
fused``) loads the same weights with perturbed routers (``perturb_routers``: an expert the
engine never picked gets 4x the row of the most used one, so the trainer's own top-k differs
while the renormalised weights at the engine's experts do not move).

The reference is the model's own code (transformers' router and eager experts loop) in float64,
fed the engine's routing: inside each router's forward the logits of the experts outside the
replayed set are pushed to -inf. With ``norm_topk_prob`` the chosen weights are
``exp(l_j) / sum_{i in chosen} exp(l_i)``, so this picks exactly the replayed experts with the
model's own weights and gradient. (The router's softmax runs in float32 there, as transformers
writes it: rounding far below the bf16 errors measured.)

Tolerances come from a measured bf16 noise floor: the same reference code run in bf16 (same
weights, same routing) against float64 gives ``floor_logp`` (max abs log-prob error) and
``floor_grad`` (relative error of each router's gradient). Then

* engine and trainer (replay) log-probs are each within ``max(4 * floor_logp, 2e-2)`` of
  float64, and within that of each other;
* without replay the trainer's log-probs are more than ``5x`` that tolerance away from the
  engine's;
* the trainer's router gradient (replay) has relative error below ``max(3 * floor_grad, 1e-2)``
  against float64, for every MoE layer.

Run on a GPU node (one GPU, ~2 min): ``python3 -m pytest -s tests/gpu/test_routing_replay_gpu.py``
(``-s`` prints the measured errors). The same check at tiny sizes on the CPU (kernels under
Triton's interpreter; not part of CI): ``uv run python tests/gpu/test_routing_replay_gpu.py``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "miles_fsdp"))

from routed_experts_testing import (  # noqa: E402
    differs,
    engine_rollout,
    moe_layers,
    own_top_k,
    perturb_routers,
    rollout_context,
    save_trainer_copy,
)

pytestmark = pytest.mark.gpu


@dataclass(frozen=True)
class MoeShape:
    """The sizes of the 2-layer qwen3_moe under test."""

    num_experts: int
    top_k: int
    hidden: int
    moe_intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int = 2
    vocab: int = 256
    prompt_len: int = 16
    response_len: int = 24  # 39 routed tokens x top-8 leave ~11 of 128 experts unused


QWEN3_30B_A3B = MoeShape(128, 8, 2048, 768, heads=32, kv_heads=4, head_dim=128)
TINY = MoeShape(64, 4, 64, 32, heads=4, kv_heads=2, head_dim=16, prompt_len=8, response_len=12)


def moe_model_config(shape: MoeShape):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=4 * shape.hidden,  # unused: every layer is MoE
        moe_intermediate_size=shape.moe_intermediate,
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.top_k,
        norm_topk_prob=True,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        # weights of std ~1.5 / sqrt(fan_in): the experts and routers matter in the output
        initializer_range=1.5 / shape.hidden**0.5,
    )


class LogitMask(TorchFunctionMode):
    """Adds ``mask`` to what ``F.linear`` returns (a router's only linear: its logits)."""

    def __init__(self, mask: torch.Tensor):
        super().__init__()
        self.mask = mask

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out + self.mask.to(out.dtype) if func is F.linear else out


@contextmanager
def routing_fed(model, routed: torch.Tensor):
    """While open, each router's own forward chooses ``routed[:, layer]``: the logits of every
    other expert are -inf (see the module docstring)."""
    gates = [model.model.layers[layer].mlp.gate for layer in moe_layers(model)]
    for layer, gate in zip(moe_layers(model), gates):
        ids = routed[:, layer].long().to(gate.weight.device)
        mask = torch.full((ids.shape[0], gate.num_experts), float("-inf"), device=ids.device)
        mask.scatter_(1, ids, 0.0)

        def forward(hidden, _original=gate.forward, _mask=mask, _ids=ids):
            with LogitMask(_mask):
                logits, weights, chosen = _original(hidden)
            assert torch.equal(chosen.sort(-1).values, _ids.sort(-1).values)
            return logits, weights, chosen

        gate.forward = forward
    try:
        yield
    finally:
        for gate in gates:
            del gate.forward  # back to the class's forward


def own_code_run(model, rollout):
    """Response log-probs (float64, CPU) and each router's gradient of their sum, of ``model``
    (transformers' code, eager experts) fed the rollout's routing. The final token is not fed
    (it predicts nothing), so the engine's ``T - 1`` rows of routed experts cover the input."""
    model.zero_grad(set_to_none=True)
    tokens = rollout.tokens.to(model.device)
    with routing_fed(model, rollout.routed):
        logits = model(input_ids=tokens[None, :-1], use_cache=False).logits[0].double()
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[1:, None]).squeeze(-1)
    logp = logp[rollout.response]
    logp.sum().backward()
    grads = {
        layer: model.model.layers[layer].mlp.gate.weight.grad.double().cpu()
        for layer in moe_layers(model)
    }
    return logp.detach().cpu(), grads


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


@dataclass
class Rollout:
    """The engine's sample: ``tokens`` (prompt + response), response log-probs, routed experts."""

    tokens: torch.Tensor
    log_probs: torch.Tensor
    routed: torch.Tensor
    response: slice  # positions of the response's log-probs among the T - 1 targets


def engine_sample(root: Path, shape: MoeShape, device: str) -> tuple[Path, Rollout]:
    """Serve a fresh bf16 model from the built-in engine on ``device``, sample one response,
    then write the trainer's copy with perturbed routers; returns (trainer dir, rollout)."""
    from transformers import AutoModelForCausalLM

    config = moe_model_config(shape)
    torch.manual_seed(0)
    with torch.device(device):  # initialised on the device: fast at real sizes
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    engine_dir = save_trainer_copy(model, root / "engine")
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(2, shape.vocab, (shape.prompt_len,), generator=gen)
    sampling = {
        "max_new_tokens": shape.response_len,
        "temperature": 1.0,
        "ignore_eos": True,
        "sampling_seed": 7,
    }
    flags = ("--device", device, "--dtype", "bfloat16")
    tokens, log_probs, routed = engine_rollout(engine_dir, config, prompt, sampling, *flags)
    response = slice(shape.prompt_len - 1, shape.prompt_len - 1 + shape.response_len)

    perturb_routers(model, routed)
    assert differs(own_top_k(model, tokens[:-1]), routed)
    return save_trainer_copy(model, root / "trainer"), Rollout(tokens, log_probs, routed, response)


def trainer_run(trainer_dir: Path, rollout: Rollout):
    """The FSDP trainer (bf16 compute, fused kernels) on the rollout: response log-probs and
    router gradients with replay, then log-probs without."""
    from miles_core.batch import RolloutBatch, Sample
    from miles_core.log_probs import token_log_probs
    from miles_core.packing import pack_thd
    from miles_fsdp.backend import FSDPBackend
    from miles_fsdp.train_step import packed_logits
    from run_args import make_args
    from torch.distributed.tensor import DTensor

    backend = FSDPBackend()
    backend.init(
        make_args(
            hf_checkpoint=str(trainer_dir),
            use_rollout_routing_replay=True,
            moe_kernel="fused",
            fsdp_compute_dtype=None,  # bf16 compute, fp32 master
        )
    )
    assert backend.precision.compute_dtype == torch.bfloat16
    assert backend.model.config._experts_implementation == "miles_fused"
    ctx = rollout_context(backend)
    tokens = rollout.tokens
    sample = Sample(
        tokens=tokens,
        response_length=rollout.response.stop - rollout.response.start,
        reward=1.0,
        routed_experts=rollout.routed,
    )
    packed = pack_thd(RolloutBatch([sample])).to(backend.device)

    def response_log_probs():
        logits = packed_logits(ctx, packed)
        return token_log_probs(logits, packed.targets, 1.0)[0, rollout.response]

    logp = response_log_probs()
    logp.sum().backward()
    grads = {}
    for layer in moe_layers(backend.model):
        grad = backend.model.model.layers[layer].mlp.gate.weight.grad
        grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
        grads[layer] = grad.double().cpu()
    ctx.routing_replay = None  # the trainer's own (perturbed) top-k
    backend.routing_replay.set(None)
    with torch.no_grad():
        own_logp = response_log_probs().double().cpu()
    backend.close()
    return logp.detach().double().cpu(), grads, own_logp


def check_routing_replay(root: Path, shape: MoeShape, device: str) -> dict:
    """The whole check (module docstring) on ``device`` at ``shape``; returns the measurements.

    Needs a 1-rank process group (NCCL on CUDA, gloo on the CPU) and, on the CPU,
    ``TRITON_INTERPRET=1`` set before miles_native's kernels are imported.
    """
    from transformers import AutoModelForCausalLM

    trainer_dir, rollout = engine_sample(root, shape, device)
    trainer_logp, trainer_grads, own_logp = trainer_run(trainer_dir, rollout)

    # the model's own code fed the engine's routing: bf16 (the noise floor), then float64
    reference = AutoModelForCausalLM.from_pretrained(
        trainer_dir, dtype=torch.bfloat16, attn_implementation="eager"
    ).to(device)
    reference.set_experts_implementation("eager")
    bf16_logp, bf16_grads = own_code_run(reference, rollout)
    reference.to(torch.float64)  # the same (bf16-valued) weights
    ref_logp, ref_grads = own_code_run(reference, rollout)
    del reference

    engine_logp = rollout.log_probs.double()
    m = {
        "floor_logp": (bf16_logp - ref_logp).abs().max().item(),
        "engine_logp": (engine_logp - ref_logp).abs().max().item(),
        "trainer_logp": (trainer_logp - ref_logp).abs().max().item(),
        "trainer_vs_engine": (trainer_logp - engine_logp).abs().max().item(),
        "no_replay_vs_engine": (own_logp - engine_logp).abs().max().item(),
        "floor_grad": max(rel_err(bf16_grads[k], ref_grads[k]) for k in ref_grads),
        "trainer_grad": {k: rel_err(trainer_grads[k], ref_grads[k]) for k in ref_grads},
    }
    m["logp_tol"] = max(4 * m["floor_logp"], 2e-2)
    m["grad_tol"] = max(3 * m["floor_grad"], 1e-2)
    print(f"routing replay at {shape} on {device}: {m}")
    assert all(ref_grads[k].abs().max() > 0 for k in ref_grads), m
    assert m["engine_logp"] <= m["logp_tol"], m
    assert m["trainer_logp"] <= m["logp_tol"], m
    assert m["trainer_vs_engine"] <= m["logp_tol"], m
    assert m["no_replay_vs_engine"] > 5 * m["logp_tol"], m
    assert all(err <= m["grad_tol"] for err in m["trainer_grad"].values()), m
    return m


@pytest.fixture
def nccl_rank(tmp_path):
    """A 1-rank NCCL process group in the test process (plus the backend's own gloo group)."""
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_replay_at_qwen3_30b_a3b_moe_shape(nccl_rank, tmp_path):
    from miles_native.kernels.fused_moe import INTERPRETED

    if INTERPRETED:
        pytest.skip("kernels were imported under TRITON_INTERPRET=1")
    check_routing_replay(tmp_path, QWEN3_30B_A3B, "cuda:0")


if __name__ == "__main__":  # the logic at tiny sizes on the CPU (not part of CI)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        try:
            check_routing_replay(Path(tmp), TINY, "cpu")
        finally:
            dist.destroy_process_group()
