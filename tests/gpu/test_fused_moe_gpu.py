"""Fused MoE Triton kernels on a CUDA device at real sizes, against float64 math.

Skipped without CUDA. The kernels are imported here, at collection, compiled for the GPU; the
interpreter tests (tests/miles_native/test_fused_moe.py) then skip in the same process.

Run on a GPU node: ``uv run pytest tests/gpu/test_fused_moe_gpu.py`` (one GPU).
"""

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from miles_native.kernels import default_config, fused_experts  # noqa: E402
from miles_native.kernels.fused_moe import INTERPRETED  # noqa: E402

if INTERPRETED:
    pytest.skip("kernels were imported under TRITON_INTERPRET=1", allow_module_level=True)

DEV = torch.device("cuda")


def reference_experts(x, w1, w2, ids, p):
    """float64 per-expert loop (the transformers formula): sum_j p_j w2[e] (silu(g) * u)."""
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        token, slot = torch.where(ids == e)
        gate, up = (x[token] @ w1[e].T).split(inter, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ w2[e].T
        out = out.index_add(0, token, y * p[token, slot, None])
    return out


def make_inputs(num_tokens, num_experts, hidden, inter, top_k, seed, empty=()):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, device=DEV, generator=gen)
    logits[:, list(empty)] = -float("inf")
    p, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    x = torch.randn(num_tokens, hidden, device=DEV, dtype=torch.float64, generator=gen)
    w1 = torch.randn(num_experts, 2 * inter, hidden, device=DEV, dtype=torch.float64, generator=gen)
    w2 = torch.randn(num_experts, hidden, inter, device=DEV, dtype=torch.float64, generator=gen)
    dy = torch.randn(num_tokens, hidden, device=DEV, dtype=torch.float64, generator=gen)
    return x, w1 / hidden**0.5, w2 / inter**0.5, ids, p.double(), dy


def rel_err(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


def check(dtype, tol, num_tokens, num_experts, hidden, inter, top_k, seed=0, empty=()):
    x, w1, w2, ids, p, dy = make_inputs(num_tokens, num_experts, hidden, inter, top_k, seed, empty)
    leaves = [t.to(dtype).double().requires_grad_() for t in (x, w1, w2, p)]
    want = reference_experts(leaves[0], leaves[1], leaves[2], ids, leaves[3])
    want.backward(dy.to(dtype).double())
    ins = [t.to(dtype).requires_grad_() for t in (x, w1, w2, p)]
    got = fused_experts(ins[0], ins[1], ins[2], ids, ins[3])
    got.backward(dy.to(dtype))
    errors = {"out": rel_err(got, want)}
    for name, a, b in zip(("hidden", "w_gate_up", "w_down", "topk_weights"), ins, leaves):
        errors[name] = rel_err(a.grad, b.grad)
    assert all(err < tol for err in errors.values()), errors
    for e in empty:
        assert torch.count_nonzero(ins[1].grad[e]) == 0 and torch.count_nonzero(ins[2].grad[e]) == 0


def test_qwen3_30b_layer_bf16():
    check(torch.bfloat16, 1e-2, 4096, 128, 2048, 768, 8, empty=(5, 77))


def test_fp32_ieee_products():
    check(torch.float32, 1e-5, 1024, 16, 1024, 384, 4, seed=1, empty=(3,))


def test_unaligned_sizes_and_tiny_token_counts():
    check(torch.bfloat16, 1e-2, 1000, 8, 1000, 300, 2, seed=2, empty=(0, 6))
    check(torch.bfloat16, 1e-2, 3, 8, 256, 128, 2, seed=3)
    check(torch.float32, 1e-5, 1, 4, 64, 32, 2, seed=4)


def test_deterministic():
    x, w1, w2, ids, p, dy = make_inputs(2048, 64, 1024, 512, 8, seed=5)
    results = []
    for _ in range(2):
        ins = [t.bfloat16().requires_grad_() for t in (x, w1, w2, p)]
        out = fused_experts(ins[0], ins[1], ins[2], ids, ins[3])
        out.backward(dy.bfloat16())
        results.append([out] + [t.grad for t in ins])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_offsets_past_int32():
    """T * k * H > 2**31: the [T*k, H] buffers need int64 offsets. Rows of a big batch equal the
    same tokens computed alone (each output row depends only on its own token)."""
    num_tokens, num_experts, hidden, inter, top_k = 140_000, 8, 2048, 128, 8
    gen = torch.Generator(device=DEV).manual_seed(6)
    x = torch.randn(num_tokens, hidden, device=DEV, dtype=torch.bfloat16, generator=gen)
    w1 = torch.randn(num_experts, 2 * inter, hidden, device=DEV, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, device=DEV, generator=gen) / inter**0.5
    w1, w2 = w1.bfloat16(), w2.bfloat16()
    ids = torch.randperm(num_experts, device=DEV)[:top_k].expand(num_tokens, top_k).contiguous()
    p = torch.rand(num_tokens, top_k, device=DEV, generator=gen).bfloat16()
    assert num_tokens * top_k * hidden > 2**31
    cfg = default_config("cuda", torch.bfloat16)  # one tiling for both calls
    out = fused_experts(x, w1, w2, ids, p, config=cfg)
    tail = slice(num_tokens - 512, num_tokens)
    alone = fused_experts(x[tail], w1, w2, ids[tail], p[tail], config=cfg)
    torch.testing.assert_close(out[tail], alone)
    want = reference_experts(
        x[tail].double(), w1.double(), w2.double(), ids[tail], p[tail].double()
    )
    assert rel_err(out[tail], want) < 1e-2


def test_transformers_experts_module_on_the_kernels():
    """Qwen3MoeExperts (bf16, "miles_fused") vs the same module's eager loop in float64."""
    transformers = pytest.importorskip("transformers")
    from miles_native.kernels.hf_experts import register_fused_experts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    register_fused_experts()
    config = transformers.Qwen3MoeConfig(
        hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8
    )
    x, w1, w2, ids, p, dy = make_inputs(2048, 128, 2048, 768, 8, seed=7)
    results = []
    for impl, dtype in (("eager", torch.float64), ("miles_fused", torch.bfloat16)):
        config._experts_implementation = impl
        experts = Qwen3MoeExperts(config).to(DEV)
        with torch.no_grad():
            experts.gate_up_proj.copy_(w1.to(torch.bfloat16))
            experts.down_proj.copy_(w2.to(torch.bfloat16))
        experts.to(dtype)
        xi = x.to(torch.bfloat16).to(dtype).requires_grad_()
        out = experts(xi, ids, p.to(torch.bfloat16).to(dtype))
        out.backward(dy.to(torch.bfloat16).to(dtype))
        results.append([out, xi.grad, experts.gate_up_proj.grad, experts.down_proj.grad])
    for name, want, got in zip(("out", "x", "gate_up", "down"), *results):
        assert rel_err(got, want) < 1e-2, name


def test_qwen3_30b_sparse_moe_block_all_gradients_bf16():
    """A whole Qwen3-30B-A3B MoE layer (router + 128 experts, top-8, H 2048, I 768), bf16 on the
    kernels, vs the same transformers block in float64 on its eager loop: output and the
    gradients of the input, the router and both expert weights.

    The float64 block routes by its own top-k. The bf16 block replays those ids (miles_fsdp's
    routing replay, the router's own softmax weights at them): with 128 experts, rounding to bf16
    would otherwise flip near-tied experts of some of the 4096 tokens.
    """
    pytest.importorskip("transformers")
    from miles_fsdp.adaptations.moe import RoutingReplay
    from miles_fsdp.adaptations.softmax_topk_replay import patch_softmax_topk_routers
    from miles_native.kernels.hf_experts import register_fused_experts
    from torch import nn
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    register_fused_experts()
    num_tokens, num_experts, hidden, inter, top_k = 4096, 128, 2048, 768, 8
    config = Qwen3MoeConfig(
        hidden_size=hidden,
        moe_intermediate_size=inter,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
    )
    gen = torch.Generator(device=DEV).manual_seed(8)

    def bf16_values(*shape, scale=1.0):  # float64 holding bf16-representable numbers
        t = torch.randn(*shape, device=DEV, dtype=torch.float64, generator=gen) * scale
        return t.bfloat16().double()

    x = bf16_values(1, num_tokens, hidden)
    weights = {
        "gate.weight": bf16_values(num_experts, hidden, scale=hidden**-0.5),
        "experts.gate_up_proj": bf16_values(num_experts, 2 * inter, hidden, scale=hidden**-0.5),
        "experts.down_proj": bf16_values(num_experts, hidden, inter, scale=inter**-0.5),
    }
    dy = bf16_values(1, num_tokens, hidden)

    results, routed = [], None
    for impl, dtype in (("eager", torch.float64), ("miles_fused", torch.bfloat16)):
        config._experts_implementation = impl
        holder = nn.Module()  # named like a model, so the router sits at layers.0.mlp.gate
        holder.layers = nn.ModuleList([nn.Module()])
        holder.layers[0].mlp = block = Qwen3MoeSparseMoeBlock(config)
        block.load_state_dict(weights)
        block.to(DEV, dtype)
        if routed is None:  # the float64 block's own top-k
            with torch.no_grad():
                routed = block.gate(x.reshape(-1, hidden))[2][:, None, :].int()
        else:
            replay = RoutingReplay()
            assert patch_softmax_topk_routers(holder, replay, {"Qwen3MoeTopKRouter"}) == 1
            replay.set(routed)
        xi = x.to(dtype).clone().requires_grad_()
        out = block(xi)
        out.backward(dy.to(dtype))
        grads = [xi.grad] + [dict(block.named_parameters())[name].grad for name in weights]
        results.append([out] + grads)
    names = ["out", "x"] + list(weights)
    errors = {n: rel_err(got, want) for n, want, got in zip(names, *results)}
    assert all(err < 1e-2 for err in errors.values()), errors


@pytest.mark.slow
def test_tiny_qwen3_moe_trains_the_same_fused_and_eager(tmp_path):
    """One GRPO rollout of a tiny qwen3_moe through the FSDP backend on one GPU (NCCL), experts
    on the kernels vs transformers' loop. fp32: equal within 1e-5 (Adam's epsilon raised so
    the first step's update is smooth in the gradient, not its sign); bf16: same loss within
    2e-2 and nearly the same update."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "miles_fsdp"))
    from moe_programs import moe_kernel_program
    from spawn import run_ranks
    from test_moe import moe_samples
    from tiny_models import arch_config, save_tiny_model

    config = arch_config("qwen3_moe")
    config.num_experts, config.num_experts_per_tok = 16, 4
    config.hidden_size, config.moe_intermediate_size = 64, 32
    hf_dir = str(save_tiny_model(tmp_path / "qwen3_moe", config))
    samples = moe_samples(8)
    got = {}
    for label, overrides in (
        ("fp32", {"fsdp_compute_dtype": "fp32", "adam_eps": 1e-2}),
        ("bf16", {"fsdp_compute_dtype": None, "adam_eps": 1e-2}),
    ):
        out = tmp_path / f"{label}.pt"
        run_ranks(
            1, moe_kernel_program, hf_dir, samples, str(out), overrides, backend="nccl", timeout=300
        )
        got[label] = torch.load(out, map_location="cpu", weights_only=True)
        assert got[label]["fused"]["impl"] == "miles_fused"
        assert got[label]["eager"]["impl"] == "eager"

    eager, fused = got["fp32"]["eager"], got["fp32"]["fused"]
    assert fused["pg_loss"] == pytest.approx(eager["pg_loss"], rel=1e-5, abs=1e-7)
    name = "model.layers.0.mlp.experts.down_proj"
    assert not torch.equal(eager["params"][name], eager["start"][name])  # trained
    for name, value in eager["params"].items():
        torch.testing.assert_close(fused["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)

    eager, fused = got["bf16"]["eager"], got["bf16"]["fused"]
    assert fused["pg_loss"] == pytest.approx(eager["pg_loss"], rel=2e-2, abs=1e-4)
    update = {k: eager["params"][k].double() - eager["start"][k].double() for k in eager["params"]}
    fused_update = {k: fused["params"][k].double() - fused["start"][k].double() for k in update}
    diff = sum((fused_update[k] - update[k]).norm() ** 2 for k in update) ** 0.5
    assert diff / sum(u.norm() ** 2 for u in update.values()) ** 0.5 < 5e-2
