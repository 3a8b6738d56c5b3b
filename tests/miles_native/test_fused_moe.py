"""Fused MoE Triton kernels on the CPU under the Triton interpreter, against float64 math.

TRITON_INTERPRET=1 must be set before the kernels are first imported (Triton decides at
decoration time), so it is set here, at collection. If another module of this process already
imported the kernels compiled for a GPU (tests/gpu), these tests skip.
"""

import os
import sys

import pytest
import torch

if "miles_native.kernels" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

kernels = pytest.importorskip("miles_native.kernels")
from miles_native.kernels import fused_moe_configs  # noqa: E402
from miles_native.kernels.fused_moe import INTERPRETED  # noqa: E402

pytestmark = pytest.mark.skipif(
    not INTERPRETED, reason="kernels were imported for the GPU in this process"
)

# Tiny shapes (the interpreter runs each program in Python). H and INTER are not multiples of the
# 32-wide CPU tiles, so every column/K mask is exercised; 16-row blocks get padded.
T, H, INTER, E, K = 13, 48, 24, 6, 2


def reference_experts(x, w1, w2, ids, p):
    """float64 loop over (token, slot): out[t] = sum_j p[t,j] w2[e] (silu(g) * u)."""
    inter = w2.shape[2]
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=x.dtype)
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = w1[e] @ x[t]
            gate, up = gate_up[:inter], gate_up[inter:]
            act = gate * torch.sigmoid(gate) * up
            acc = acc + p[t, j] * (w2[e] @ act)
        rows.append(acc)
    return torch.stack(rows)


def make_inputs(num_tokens, seed, unused_experts=(1, 4)):
    """Random routing over the experts not in ``unused_experts`` (those get zero tokens)."""
    gen = torch.Generator().manual_seed(seed)
    used = torch.tensor([e for e in range(E) if e not in unused_experts])
    ids = torch.stack(
        [used[torch.randperm(len(used), generator=gen)[:K]] for _ in range(num_tokens)]
    )
    x = torch.randn(num_tokens, H, generator=gen, dtype=torch.float64)
    w1 = torch.randn(E, 2 * INTER, H, generator=gen, dtype=torch.float64) / H**0.5
    w2 = torch.randn(E, H, INTER, generator=gen, dtype=torch.float64) / INTER**0.5
    p = torch.rand(num_tokens, K, generator=gen, dtype=torch.float64)
    dy = torch.randn(num_tokens, H, generator=gen, dtype=torch.float64)
    return x, w1, w2, ids, p, dy


def rel_err(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


def run_both(dtype, num_tokens=T, seed=0, unused_experts=(1, 4)):
    x, w1, w2, ids, p, dy = make_inputs(num_tokens, seed, unused_experts)
    # The reference sees exactly the (rounded) values the kernels see.
    leaves = [t.to(dtype).double().requires_grad_() for t in (x, w1, w2, p)]
    want = reference_experts(leaves[0], leaves[1], leaves[2], ids, leaves[3])
    want.backward(dy.to(dtype).double())
    ins = [t.to(dtype).requires_grad_() for t in (x, w1, w2, p)]
    got = kernels.fused_experts(ins[0], ins[1], ins[2], ids, ins[3])
    got.backward(dy.to(dtype))
    return got, want, ins, leaves, ids


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-2)]
)
def test_forward_and_every_gradient_match_float64(dtype, tol):
    got, want, ins, leaves, _ = run_both(dtype)
    assert got.dtype == dtype and got.shape == (T, H)
    assert rel_err(got, want) < tol
    for name, a, b in zip(("hidden", "w_gate_up", "w_down", "topk_weights"), ins, leaves):
        assert a.grad.dtype == dtype, name
        assert rel_err(a.grad, b.grad) < tol, (name, rel_err(a.grad, b.grad))


def test_experts_without_tokens_get_exactly_zero_weight_grads():
    _, _, ins, leaves, ids = run_both(torch.float32, seed=1, unused_experts=(0, 3, 5))
    assert set(ids.unique().tolist()) == {1, 2, 4}
    for e in (0, 3, 5):
        assert torch.count_nonzero(ins[1].grad[e]) == 0
        assert torch.count_nonzero(ins[2].grad[e]) == 0
    for e in (1, 2, 4):
        assert rel_err(ins[1].grad[e], leaves[1].grad[e]) < 1e-5
        assert rel_err(ins[2].grad[e], leaves[2].grad[e]) < 1e-5


def test_all_tokens_on_one_expert_spanning_several_row_blocks():
    """40 tokens x top-1 on expert 2: three 16-row blocks, the last one padded."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, H, generator=gen)
    w1 = torch.randn(E, 2 * INTER, H, generator=gen) / H**0.5
    w2 = torch.randn(E, H, INTER, generator=gen) / INTER**0.5
    ids = torch.full((40, 1), 2)
    p = torch.rand(40, 1, generator=gen)
    w1.requires_grad_()
    got = kernels.fused_experts(x, w1, w2, ids, p)
    want = reference_experts(x.double(), w1.double(), w2.double(), ids, p.double())
    assert rel_err(got, want) < 1e-5
    got.sum().backward()
    assert torch.count_nonzero(w1.grad[torch.arange(E) != 2]) == 0


def test_only_requested_gradients_are_computed():
    x, w1, w2, ids, p, _ = make_inputs(5, seed=4)
    x, w1, w2, p = (t.float() for t in (x, w1, w2, p))
    x.requires_grad_()
    out = kernels.fused_experts(x, w1, w2, ids, p)
    (grad_x,) = torch.autograd.grad(out.sum(), x)
    xd = x.detach().double().requires_grad_()
    want = reference_experts(xd, w1.double(), w2.double(), ids, p.double())
    want.sum().backward()
    assert rel_err(grad_x, xd.grad) < 1e-5
    assert w1.grad is None and w2.grad is None and p.grad is None


def test_no_tokens():
    x = torch.zeros(0, H, requires_grad=True)
    w1 = torch.randn(E, 2 * INTER, H, requires_grad=True)
    w2 = torch.randn(E, H, INTER, requires_grad=True)
    p = torch.zeros(0, K, requires_grad=True)
    out = kernels.fused_experts(x, w1, w2, torch.zeros(0, K, dtype=torch.long), p)
    assert out.shape == (0, H)
    out.sum().backward()
    assert x.grad.shape == (0, H) and p.grad.shape == (0, K)
    assert torch.count_nonzero(w1.grad) == 0 and torch.count_nonzero(w2.grad) == 0


def test_alignment_groups_by_expert_pads_blocks_and_keeps_token_order():
    ids = torch.tensor([[3, 0], [3, 2], [0, 3], [2, 3], [3, 0]])
    align = kernels.align_by_expert(ids, num_experts=5, block_m=4)
    s = ids.numel()
    # Independent construction: for each expert in order, its assignments ascending, then pad.
    want_rows, want_blocks = [], []
    for e in range(5):
        rows = [a for a in range(s) if ids.reshape(-1)[a] == e]
        padded = rows + [s] * (-len(rows) % 4)
        want_rows += padded
        want_blocks += [e] * (len(padded) // 4)
    used = len(want_rows)
    assert align.sorted_ids[:used].tolist() == want_rows
    assert (align.sorted_ids[used:] == s).all()
    assert align.block_expert[: used // 4].tolist() == want_blocks
    assert (align.block_expert[used // 4 :] == -1).all()
    assert align.expert_pstarts.tolist() == [0, 4, 4, 8, 16, 16]
    assert align.max_rows >= s + 5 * 3 and align.max_rows % 4 == 0


def test_bad_inputs_name_the_argument():
    x, w1, w2, ids, p, _ = make_inputs(4, seed=5)
    x, w1, w2, p = (t.float() for t in (x, w1, w2, p))
    with pytest.raises(ValueError, match="w_gate_up"):
        kernels.fused_experts(x, w1[:, : 2 * INTER - 2], w2, ids, p)
    with pytest.raises(ValueError, match="topk_weights"):
        kernels.fused_experts(x, w1, w2, ids, p[:, :1])
    with pytest.raises(ValueError, match="dtype"):
        kernels.fused_experts(x.bfloat16(), w1, w2, ids, p)
    with pytest.raises(ValueError, match="topk_ids"):
        kernels.fused_experts(x, w1, w2, ids.float(), p)


def test_config_table_round_trip_and_nearest_bucket(tmp_path, monkeypatch):
    default = kernels.default_config("cuda", torch.bfloat16)
    from_dict = fused_moe_configs.FusedMoEConfig.from_dict
    cfg_small = from_dict({**default.to_dict(), "block_m": 32})
    cfg_big = from_dict({**default.to_dict(), "block_m": 128})
    monkeypatch.setattr(fused_moe_configs, "CONFIG_DIR", tmp_path)
    path = fused_moe_configs.device_table_path("Fake GPU 9000")
    assert path == tmp_path / "Fake_GPU_9000.json"
    key = fused_moe_configs.shape_key(128, 2048, 768, 8, torch.bfloat16)
    assert key == "E=128,H=2048,I=768,k=8,dtype=bfloat16"
    fused_moe_configs.save_table(path, "Fake GPU 9000", {key: {4096: cfg_small}})
    fused_moe_configs.save_table(path, "Fake GPU 9000", {key: {65536: cfg_big}})
    table = fused_moe_configs.load_table(path)
    assert table[key] == {4096: cfg_small, 65536: cfg_big}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU 9000")
    cuda = torch.device("cuda")
    lookup = fused_moe_configs.get_config
    assert lookup(8000, 128, 2048, 768, 8, torch.bfloat16, cuda) == cfg_small
    assert lookup(30000, 128, 2048, 768, 8, torch.bfloat16, cuda) == cfg_big
    # Another shape or dtype falls back to the defaults.
    assert lookup(8000, 64, 2048, 768, 8, torch.bfloat16, cuda) == default
    assert lookup(8000, 128, 2048, 768, 8, torch.float32, cuda) == kernels.default_config(
        "cuda", torch.float32
    )
    path.write_text('{"entries": {"x": {"1": {"block_m": 16}}}}')
    fused_moe_configs.load_table.cache_clear()
    with pytest.raises(ValueError, match="Fake_GPU_9000.json"):
        lookup(8000, 128, 2048, 768, 8, torch.bfloat16, cuda)
