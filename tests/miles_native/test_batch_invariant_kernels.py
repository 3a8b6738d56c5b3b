"""The GPU kernels of --true-on-policy (miles_native.kernels.batch_invariant) on the CPU under
the Triton interpreter: a row computed alone, in a batch of other rows and in a pack gives the
same bits (attention: prefill, decode against a cache and a packed row), in fp32 and bf16; each
value against a float64 reference within the bounds of tests/tolerances.py; the backward (plain
torch) against float64 autograd.

TRITON_INTERPRET=1 must be set before the kernels are first imported (test_fused_moe.py says
why). Tiny shapes: the interpreter runs each program in Python; the multi-block attention case
is under ``extended``.
"""

import os
import sys

import pytest
import torch

if "miles_native.kernels" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

K = pytest.importorskip("miles_native.kernels.batch_invariant")
from tolerances import (  # noqa: E402
    GRAD_REL_ERR,
    attention_atol,
    dot_atol,
    grad_atol,
    log_softmax_atol,
    row_mean_atol,
)

pytestmark = [
    pytest.mark.numeric,
    pytest.mark.skipif(not K.INTERPRETED, reason="kernels were imported for the GPU"),
]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _within(got, ref, atol, what):
    err = (got.double() - ref).abs()
    assert (err <= atol).all(), f"{what}: worst excess {float((err - atol).max()):.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_row_alone_in_a_batch_and_in_a_pack(dtype):
    """Row 133 of 200 (K = 80: two K blocks, the second masked; N = 136: two N tiles): alone
    (row 0 of its M tile), in a batch of 5 (row 3), in the whole 200 (row 5 of the second or
    third tile) and in a packed [1, 200, K] input."""
    k, n = 80, 136
    w, b = torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
    x = torch.randn(200, k).to(dtype)
    alone = K.linear_forward(x[133:134], w, b)[0]
    batch5 = K.linear_forward(x[130:135], w, b)[3]
    full = K.linear_forward(x, w, b)[133]
    packed = K.linear_forward(x[None], w, b)[0, 133]
    block_m, block_n, block_k, _, _ = K.MATMUL_CONFIGS[dtype]
    assert 133 // block_m > 0 and 133 % block_m not in (0, 3)  # another tile, another row
    assert k > block_k and n > block_n  # coverage: K loop and N tiles
    for other in (batch5, full, packed):
        assert torch.equal(alone, other)
    # the bias is added in fp32 before the one rounding: it joins the sum's terms
    terms = x[133].double().abs() @ w.double().abs().T + b.double().abs()
    ref = x[133].double() @ w.double().T + b.double()
    _within(alone, ref, dot_atol(ref, terms, k + 1, dtype), "linear")


def _spans_and_run(q, k, v, mask, scale):
    return K.attention(q, k, v, mask, scale)


def _attention_cases(dtype, length: int, query: int):
    """Query ``query`` of sample A (``length`` tokens; 2 heads over 1 KV head, D = 16): in a
    prefill of A alone, left-padded by 3 beside a longer sample, as a decode step against the
    left-padded cache, and in a packed row behind a 9-token sample (its keys start at 9)."""
    heads, kv_heads, dim, pad, other_len = 2, 1, 16, 3, length + 3
    a_q = torch.randn(heads, length, dim).to(dtype)
    a_k, a_v = (torch.randn(kv_heads, length, dim).to(dtype) for _ in range(2))
    o_q = torch.randn(heads, other_len, dim).to(dtype)
    o_k, o_v = (torch.randn(kv_heads, other_len, dim).to(dtype) for _ in range(2))
    scale = dim**-0.5
    causal = lambda n: torch.ones(n, n, dtype=torch.bool).tril()  # noqa: E731
    alone = _spans_and_run(a_q[None], a_k[None], a_v[None], causal(length)[None, None], scale)
    alone = alone[0, query]

    def padded(t, n):
        return torch.cat([torch.zeros(t.shape[0], n, dim, dtype=dtype), t], 1)

    q = torch.stack([padded(a_q, pad), o_q])
    k = torch.stack([padded(a_k, pad), o_k])
    v = torch.stack([padded(a_v, pad), o_v])
    real = torch.tensor([[0] * pad + [1] * length, [1] * other_len], dtype=torch.bool)
    mask = (causal(other_len)[None] & real[:, None, :])[:, None]
    batch = _spans_and_run(q, k, v, mask, scale)[0, pad + query]
    cached = slice(0, pad + query + 1)
    decode_mask = real[:, None, None, cached]
    decode = _spans_and_run(
        q[:, :, pad + query : pad + query + 1], k[:, :, cached], v[:, :, cached], decode_mask, scale
    )[0, 0]
    seg = torch.tensor([0] * 9 + [1] * length)
    pack_mask = ((seg[:, None] == seg[None]) & causal(9 + length))[None, None]
    pq, pk, pv = (
        torch.cat([t[..., :9, :], a], 1)[None] for t, a in ((o_q, a_q), (o_k, a_k), (o_v, a_v))
    )
    packed = _spans_and_run(pq, pk, pv, pack_mask, scale)[0, 9 + query]
    # coverage: four launches of different shapes, the key range starting at 0, 3 and 9
    starts = {int(K.key_spans(m)[0].flatten()[i]) for m, i in
              ((causal(length)[None, None], query), (mask, pad + query), (pack_mask, 9 + query))}  # fmt: skip
    assert starts == {0, pad, 9}
    if 9 + query < K.ATTN_CONFIG[0]:  # coverage: the tile holds both samples' queries (two passes)
        assert set(K.key_spans(pack_mask)[0][0, : 9 + length].tolist()) == {0, 9}
    for other in (batch, decode, packed):
        assert torch.equal(alone, other)
    kq = a_k[:, : query + 1].double().repeat_interleave(heads // kv_heads, 0)
    vq = a_v[:, : query + 1].double().repeat_interleave(heads // kv_heads, 0)
    s = torch.einsum("hd,hnd->hn", a_q[:, query].double(), kq) * scale
    ref = torch.einsum("hn,hnd->hd", torch.softmax(s, -1), vq)
    s_abs = torch.einsum("hd,hnd->hn", a_q[:, query].double().abs(), kq.abs()) * scale
    atol = attention_atol(ref, float(s_abs.max()), query + 1, float(vq.abs().max()), dim, dtype)
    _within(alone, ref, atol, "attention")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_prefill_decode_and_pack_agree(dtype):
    _attention_cases(dtype, length=7, query=5)


@pytest.mark.extended
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_over_several_key_blocks(dtype):
    """70 keys for query 68: two blocks of ATTN_BLOCK_N, the second partly masked (and in the
    pack, a second tile of queries)."""
    assert 69 > K.ATTN_BLOCK_N and 9 + 68 >= K.ATTN_CONFIG[0]
    _attention_cases(dtype, length=70, query=68)


def test_attention_refuses_a_mask_with_holes():
    mask = torch.tensor([True, False, True])[None, None, None]
    with pytest.raises(ValueError, match="not one contiguous range"):
        K.key_spans(mask)
    with pytest.raises(ValueError, match="boolean"):
        K.key_spans(mask.float())
    empty = torch.zeros(1, 1, 2, 3, dtype=torch.bool)
    q = torch.randn(1, 2, 2, 4)
    assert torch.equal(K.attention(q, q, q, empty, 0.5), torch.zeros(1, 2, 2, 4))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_mean_alone_in_a_batch(dtype):
    """1100 columns: two chunks of ROW_BLOCK lanes, the second masked."""
    x = torch.randn(33, 1100).to(dtype)
    alone = K.row_mean_forward(x[3:4])[0]
    assert torch.equal(alone, K.row_mean_forward(x[:5])[3])
    assert torch.equal(alone, K.row_mean_forward(x.reshape(3, 11, 1100))[0, 3])
    assert x.shape[1] > K.ROW_BLOCK
    ref = x[3].double().mean()
    _within(alone, ref, row_mean_atol(ref, x[3].double().abs().mean(), 1100, dtype), "mean")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_log_softmax_engine_and_trainer_temperatures_agree(dtype):
    """The engine passes a tensor of one temperature per row, the trainer one float: the same
    bits, row alone or in a batch."""
    x = torch.randn(6, 1100).to(dtype) * 4
    engine = K.log_softmax_forward(x, torch.full((6, 1), 0.7))
    trainer = K.log_softmax_forward(x[None], 0.7)[0]
    alone = K.log_softmax_forward(x[2:3], 0.7)[0]
    assert engine.dtype == torch.float32
    assert torch.equal(engine, trainer) and torch.equal(alone, engine[2])
    t = torch.tensor(0.7, dtype=torch.float32).double()
    ref = torch.log_softmax(x.double() / t, -1)
    _within(engine, ref, log_softmax_atol(ref, x.double() / t, x.shape[1]), "log_softmax")


def _masked_sdpa(q, k, v, mask, scale):
    """float64 reference: softmax attention over the mask's keys; zeros where it allows none."""
    empty = ~mask.any(-1, keepdim=True)
    y = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask | empty, scale=scale, enable_gqa=True
    )
    return torch.where(empty, 0.0, y).transpose(1, 2)


def test_backward_is_torch_s_within_fp32_rounding():
    """Each op's gradient (plain torch in fp32) against float64 autograd of its formula; the
    attention's (the masked SDPA) on a packed row and on a left-padded batch."""
    d = torch.float64
    x = torch.randn(5, 24, requires_grad=True)
    w = torch.randn(8, 24, requires_grad=True)
    q = torch.randn(1, 2, 8, 8, requires_grad=True)
    kv = torch.randn(1, 1, 8, 8, requires_grad=True)
    seg = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    pack = ((seg[:, None] == seg[None]) & causal)[None, None]
    qb = torch.randn(2, 2, 8, 8, requires_grad=True)
    kvb = torch.randn(2, 1, 8, 8, requires_grad=True)
    real = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8], dtype=torch.bool)
    padded = (causal[None] & real[:, None, :])[:, None]
    assert not padded.any(-1).all()  # coverage: a query with no key (left padding)
    cases = [
        (lambda a, b: K.linear(a, b), lambda a, b: a @ b.T, (x, w)),
        (lambda a: K.row_mean(a, keepdim=True), lambda a: a.mean(-1, keepdim=True), (x,)),
        (lambda a: K.log_softmax(a, 0.7), lambda a: torch.log_softmax(a / 0.7, -1), (x,)),
        (
            lambda a, b: K.attention(a, b, b, pack, 0.3),
            lambda a, b: _masked_sdpa(a, b, b, pack, 0.3),
            (q, kv),
        ),
        (
            lambda a, b: K.attention(a, b, b, padded, 0.3),
            lambda a, b: _masked_sdpa(a, b, b, padded, 0.3),
            (qb, kvb),
        ),
    ]
    for op, formula, inputs in cases:
        out = op(*inputs)
        g = torch.randn_like(out)
        got = torch.autograd.grad(out, inputs, g)
        ref_in = [t.detach().to(d).requires_grad_(True) for t in inputs]
        want = torch.autograd.grad(formula(*ref_in), ref_in, g.to(d))
        for a, b in zip(got, want):
            _within(a, b, grad_atol(b, GRAD_REL_ERR), "gradient")


def test_one_mask_s_spans_are_computed_once(monkeypatch):
    """transformers hands every layer the same mask object: its spans (one host sync) are
    computed at the first layer; an in-place change or another mask computes them again."""
    calls = []
    real = K.key_spans
    monkeypatch.setattr(K, "key_spans", lambda m: calls.append(1) or real(m))
    q = torch.randn(1, 2, 3, 4)
    mask = torch.ones(3, 3, dtype=torch.bool).tril()[None, None]
    first = K.attention(q, q, q, mask, 0.5)
    assert torch.equal(first, K.attention(q, q, q, mask, 0.5)) and len(calls) == 1
    mask[..., 0] = False  # in place: query 0 now sees no key
    changed = K.attention(q, q, q, mask, 0.5)
    assert len(calls) == 2 and torch.equal(changed[0, 0], torch.zeros(2, 4))
    K.attention(q, q, q, mask.clone(), 0.5)
    assert len(calls) == 3


def test_packed_row_attention_is_the_masked_kernel_s_with_a_varlen_backward():
    """miles_core.batch_invariant.packed_attention (the trainer's packed row on a GPU): the
    spans from the boundaries equal the block-diagonal mask's, so the forward is the masked
    kernel's bit for bit; the backward (the varlen path: one causal SDPA per sample on the CPU)
    against float64 autograd of the masked formula. Three samples and a padding segment, GQA."""
    from miles_core.batch_invariant import packed_attention, packed_spans

    cu = torch.tensor([0, 3, 8, 13, 16], dtype=torch.int32)
    seg = torch.repeat_interleave(torch.arange(4), cu.diff())
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    pack = ((seg[:, None] == seg[None]) & causal)[None, None]
    assert [int(x) for x in packed_spans(cu, 16)[0][0, [0, 2, 3, 7, 8, 15]]] == [0, 0, 3, 3, 8, 13]
    for got, want in zip(packed_spans(cu, 16), K.key_spans(pack)):
        assert torch.equal(got, want)
    q = torch.randn(1, 4, 16, 8, requires_grad=True)
    k = torch.randn(1, 2, 16, 8, requires_grad=True)
    v = torch.randn(1, 2, 16, 8, requires_grad=True)
    out = packed_attention(q, k, v, cu, 5, 0.3)
    assert torch.equal(out, K.attention(q, k, v, pack, 0.3))
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    ref_in = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    want = torch.autograd.grad(_masked_sdpa(*ref_in, pack, 0.3), ref_in, g.double())
    for a, b in zip(got, want):
        assert a.shape == b.shape and b.abs().max() > 0  # coverage: every input gets a gradient
        _within(a, b, grad_atol(b, GRAD_REL_ERR), "packed gradient")
