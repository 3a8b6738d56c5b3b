"""miles_core.batch_invariant: one token's result is the same bits alone, in a batch of 5 and in
a pack; each op also against a float64 reference written here, and torch's own kernels shown
to differ where they do (so the equality checks can fail)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from miles_core import batch_invariant as bi
from miles_core.log_probs import token_log_probs
from tolerances import ulp_atol

pytestmark = pytest.mark.numeric


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_linear_row_alone_in_a_batch_and_in_a_pack():
    w, b = torch.randn(48, 64), torch.randn(48)
    x = torch.randn(7, 64)
    with bi.mode():
        alone = F.linear(x[3:4], w, b)[0]
        batch5 = F.linear(x[:5], w, b)[3]
        pack = F.linear(x.reshape(1, 7, 64), w, b)[0, 3]
    assert torch.equal(alone, batch5) and torch.equal(alone, pack)
    ref = x[3].double() @ w.double().T + b.double()
    atol = 64 * ulp_atol(ref.abs() + (x[3].double().abs() @ w.double().abs().T), ulps=1)
    assert ((alone.double() - ref).abs() <= atol).all()
    # torch's own kernel (one row is a GEMV, five rows a GEMM) rounds differently
    plain_alone, plain_batch = F.linear(x[3:4], w, b)[0], F.linear(x[:5], w, b)[3]
    assert not torch.equal(plain_alone, plain_batch)


def test_mode_routes_linear_and_sets_one_thread(monkeypatch):
    calls = []
    real = bi.linear
    monkeypatch.setattr(bi, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    before = torch.get_num_threads()
    layer = torch.nn.Linear(8, 4)
    with bi.mode():
        assert torch.get_num_threads() == bi.NUM_THREADS
        layer(torch.randn(2, 8))
    assert calls == [1]  # nn.Linear reached the mode's linear
    assert torch.get_num_threads() == before
    layer(torch.randn(2, 8))
    assert calls == [1]  # and nothing outside the mode


def test_linear_gradients_match_torch():
    w = torch.randn(16, 32, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 5, 32, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 5, 16, dtype=torch.float64)
    with bi.mode():
        F.linear(x, w).backward(g)
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    (x @ w.T).backward(g)  # float64: the two agree to float64 rounding
    torch.testing.assert_close(gx, x.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw, w.grad, rtol=1e-12, atol=1e-12)


def _reference_attention(q, k, v, scale):
    """float64 softmax(q k^T * scale) v for one query (H, D) over keys (H, n, D)."""
    s = torch.einsum("hd,hnd->hn", q.double(), k.double()) * scale
    return torch.einsum("hn,hnd->hd", torch.softmax(s, -1), v.double())


def test_attention_prefill_decode_and_pack_agree():
    """Query 4 of sample A (6 tokens; 4 heads, 2 KV heads): in a prefill of A alone, in a
    left-padded prefill beside a longer sample, as a decode step against a left-padded cache,
    and in a packed row behind another sample (block-diagonal mask)."""
    heads, kv_heads, dim = 4, 2, 16
    a_q = torch.randn(heads, 6, dim)
    a_k, a_v = torch.randn(kv_heads, 6, dim), torch.randn(kv_heads, 6, dim)
    other_k, other_v = torch.randn(kv_heads, 9, dim), torch.randn(kv_heads, 9, dim)
    other_q = torch.randn(heads, 9, dim)
    causal = lambda n: torch.ones(n, n, dtype=torch.bool).tril()  # noqa: E731

    def run(q, k, v, mask):
        with bi.mode():
            return bi.attention(None, q, k, v, mask)[0]

    alone = run(a_q[None], a_k[None], a_v[None], causal(6)[None, None])[0, 4]
    # left-padded batch [pad x3, A] beside a 9-token sample
    pad = 3
    q = torch.stack([torch.cat([torch.zeros(heads, pad, dim), a_q], 1), other_q])
    k = torch.stack([torch.cat([torch.zeros(kv_heads, pad, dim), a_k], 1), other_k])
    v = torch.stack([torch.cat([torch.zeros(kv_heads, pad, dim), a_v], 1), other_v])
    real = torch.tensor([[0] * pad + [1] * 6, [1] * 9], dtype=torch.bool)
    mask = causal(9)[None] & real[:, None, :]
    batch = run(q, k, v, mask[:, None])[0, pad + 4]
    # decode step of position 4: cache holds positions 0..3 (left-padded), the query is the new one
    decode_mask = real[:, : pad + 5][:, None, None, :]
    cached = slice(0, pad + 5)
    decode = run(q[:, :, pad + 4 : pad + 5], k[:, :, cached], v[:, :, cached], decode_mask)
    decode = decode[0, 0]
    # packed row [other (9), A (6)]
    seg = torch.tensor([0] * 9 + [1] * 6)
    pack_mask = (seg[:, None] == seg[None]) & causal(15)
    packed = run(
        torch.cat([other_q, a_q], 1)[None],
        torch.cat([other_k, a_k], 1)[None],
        torch.cat([other_v, a_v], 1)[None],
        pack_mask[None, None],
    )[0, 9 + 4]
    for other in (batch, decode, packed):
        assert torch.equal(alone, other)
    ref = _reference_attention(a_q[:, 4], a_k[:, :5].repeat_interleave(2, 0),
                               a_v[:, :5].repeat_interleave(2, 0), dim**-0.5)  # fmt: skip
    torch.testing.assert_close(alone.double(), ref, rtol=0, atol=float(ulp_atol(ref, 64).max()))
    # torch's SDPA on the same packed row and on A alone: not the same bits
    sdpa_alone = F.scaled_dot_product_attention(
        a_q[None], a_k[None], a_v[None], is_causal=True, enable_gqa=True
    )[0, :, 4]
    sdpa_packed = F.scaled_dot_product_attention(
        torch.cat([other_q, a_q], 1)[None],
        torch.cat([other_k, a_k], 1)[None],
        torch.cat([other_v, a_v], 1)[None],
        attn_mask=pack_mask[None, None],
        enable_gqa=True,
    )[0, :, 13]
    assert not torch.equal(sdpa_alone, sdpa_packed)


def test_attention_refuses_what_it_cannot_compute():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="boolean 4-D attention mask"):
        bi.attention(None, q, q, q, None)
    with pytest.raises(ValueError, match="dropout"):
        bi.attention(None, q, q, q, torch.ones(1, 1, 3, 3, dtype=torch.bool), dropout=0.1)


@pytest.mark.parametrize(
    "name, op",
    [
        ("rms_norm", lambda t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)),
        ("softmax", lambda t: torch.softmax(t, -1)),
        ("log_softmax", lambda t: torch.log_softmax(t, -1)),
    ],
)
def test_row_reductions_are_batch_invariant_under_the_mode(name, op):
    """The mode leaves these to torch: with its one thread each row is the same bits alone, in
    a batch of 5 and in a batch of 300 (torch is invariant here without the mode too)."""
    x = torch.randn(300, 512)
    with bi.mode():
        alone = op(x[3:4])[0]
        assert torch.equal(alone, op(x[:5])[3]) and torch.equal(alone, op(x)[3])


def test_engine_and_trainer_temperature_scaling_agree():
    """The engine's sampler scales a batch of rows by a tensor of temperatures
    (builtin_engine.scheduler._append_tokens); the trainer divides a packed row by the float
    (token_log_probs): the same bits."""
    logits = torch.randn(5, 64)
    targets = torch.randint(0, 64, (5,))
    temperature = 0.7
    temps = torch.tensor([temperature] * 5)
    engine = torch.log_softmax(logits.float() / temps[:, None], dim=-1)
    with bi.mode():
        trainer = token_log_probs(logits[None], targets[None], temperature)[0]
    assert torch.equal(engine.gather(-1, targets[:, None])[:, 0], trainer)
