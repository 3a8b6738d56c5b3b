"""The fused hidden-states -> log-prob/entropy head equals the dense path (materialised logits).

Bounds come from the arithmetic, not from a run:

* float64 (the algebra): the chunked forward and the hand-written backward are the same
  functions as the dense softmax and its autograd, so in float64 they differ by rounding only:
  a few hundred float64 roundings of the operands' scale (``F64_BOUND`` relative), far below any
  algebra mistake (a missing temperature factor or entropy term is O(1)). The values are checked
  against plain Python with exact sums (``_exact``), which shares no kernel with torch; the
  gradients against torch's autograd through the dense softmax.
* float32 (the rounding): each logit ``z = h.w / T`` is a length-``H`` dot product; its error is
  at most ``gamma_H * (|h| @ |W|^T) / T`` (``gamma_H = H u / (1 - H u)``, ``u`` fp32's unit
  roundoff). ``log_prob = z_t - lse`` and ``entropy = log s - E[z - m]`` move by at most twice
  the row's largest logit error (``lse`` and ``E`` are weighted means of the logits) plus the
  rounding of the length-``V`` sums (``(V + 8) u`` relative to their magnitude).
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch
from miles_core.log_prob_head import chunk_size, dense_log_probs, fused_log_probs
from miles_core.ports import free_port
from rank_context import in_environ, rank_context
from timeouts import scaled
from tolerances import FP32_EPS

F64_BOUND = 2.0**-52 * 512


def _inputs(n=37, h=16, v=101, dtype=torch.float64, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * scale).to(dtype)
    weight = torch.randn(v, h, generator=g).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


def _dense(hidden, weight, targets, temperature, vocab_size=None):
    logits = hidden @ weight.t()
    if vocab_size is not None:
        logits = logits[..., :vocab_size]
    lp = torch.log_softmax(logits.double() / temperature, -1)
    ent = -(lp.exp() * lp).sum(-1)
    return lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), ent


def _exact(hidden, weight, targets, temperature, vocab_size=None):
    """``(log_prob, entropy)`` per row in plain Python float64 with exact sums (``math.fsum``):
    a reference that shares no kernel with torch (the torch references' own vectorised exp, sums
    and matmuls are what a float64 comparison would otherwise also be testing)."""
    rows = hidden.tolist()
    w = weight.tolist()[:vocab_size]
    lps, ents = [], []
    for h, t in zip(rows, targets.tolist()):
        z = [math.fsum(a * b for a, b in zip(h, wv)) / temperature for wv in w]
        m = max(z)
        e = [math.exp(v - m) for v in z]
        s = math.fsum(e)
        lps.append(z[t] - m - math.log(s))
        ents.append(math.log(s) - math.fsum(ev * (v - m) for ev, v in zip(e, z)) / s)
    return torch.tensor(lps, dtype=torch.float64), torch.tensor(ents, dtype=torch.float64)


def _close_rows(a, exact, bound, what, dense=None):
    """``a`` within ``bound`` of the exact reference; a failure names the row and what the torch
    dense reference gives there, so a kernel's error is told apart from the head's."""
    err = (a.double() - exact).abs()
    row = int(err.argmax())
    detail = f"row {row}: got {a[row].item():.17g}, exact {exact[row].item():.17g}"
    if dense is not None:
        detail += f", torch dense {dense[row].item():.17g}"
    assert err[row] <= bound, f"{what}: max error {err[row]:.3e} > bound {bound:.3e} ({detail})"


def _grads(fn, hidden, weight, g_lp, g_ent):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    lp, ent = fn(h, w)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _close(a, b, bound, what):
    err = (a.double() - b.double()).abs().max().item()
    assert err <= bound, f"{what}: max error {err:.3e} > bound {bound:.3e}"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 8, 1000])
def test_float64_values_and_grads_equal_dense(temperature, chunk):
    hidden, weight, targets = _inputs()
    g = torch.Generator().manual_seed(5)
    g_lp = torch.randn(hidden.shape[0], generator=g, dtype=torch.float64)
    g_ent = torch.randn(hidden.shape[0], generator=g, dtype=torch.float64)
    ref = _grads(lambda h, w: _dense(h, w, targets, temperature), hidden, weight, g_lp, g_ent)
    got = _grads(
        lambda h, w: fused_log_probs(h, w, targets, temperature, chunk_tokens=chunk),
        hidden,
        weight,
        g_lp,
        g_ent,
    )
    for name, a, exact, dense in zip(
        ("log_prob", "entropy"), got, _exact(hidden, weight, targets, temperature), ref
    ):
        _close_rows(a, exact, F64_BOUND * max(1.0, exact.abs().max().item()), name, dense)
    for name, a, b in zip(("grad_h", "grad_w"), got[2:], ref[2:]):
        _close(a, b, F64_BOUND * max(1.0, b.abs().max().item()), name)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_float64_log_prob_only_grads_equal_dense(temperature):
    """``entropy_grad=False`` (the entropy a metric): no gradient flows from the entropy, and
    the log-prob-only backward (computed in place) gives the dense path's gradients."""
    hidden, weight, targets = _inputs()
    g_lp = torch.randn(hidden.shape[0], generator=torch.Generator().manual_seed(5)).double()
    zero = torch.zeros_like(g_lp)
    ref = _grads(lambda h, w: _dense(h, w, targets, temperature), hidden, weight, g_lp, zero)
    got = _grads(
        lambda h, w: fused_log_probs(
            h, w, targets, temperature, chunk_tokens=8, entropy_grad=False
        ),
        hidden,
        weight,
        g_lp,
        g_lp,  # would change the gradients if the entropy carried one
    )
    for name, a, b in zip(("log_prob", "entropy", "grad_h", "grad_w"), got, ref):
        _close(a, b, F64_BOUND * max(1.0, b.abs().max().item()), name)


def test_tied_weight_grads_sum_both_uses_and_only_one_output_backpropagates():
    """A tied embedding: the same parameter embeds the inputs and projects the outputs; the
    fused head's weight gradient adds to the embedding's. Only the log-prob is back-propagated
    (the entropy is a metric, no grad flows from it)."""
    hidden, weight, targets = _inputs(n=20, v=30)
    ids = torch.randint(0, 30, (20,), generator=torch.Generator().manual_seed(2))

    def run(fused):
        w = weight.clone().requires_grad_(True)
        h = torch.tanh(w[ids] + hidden)  # embedding lookup feeds the hidden states
        if fused:
            lp, _ = fused_log_probs(h, w, targets, 1.3, chunk_tokens=3)
        else:
            lp, _ = _dense(h, w, targets, 1.3)
        lp.sum().backward()
        return w.grad

    _close(run(True), run(False), F64_BOUND * run(False).abs().max().item(), "tied grad")


def test_padded_vocabulary_rows_take_no_probability():
    hidden, weight, targets = _inputs(v=64)
    targets = targets % 50
    ref = _dense(hidden, weight, targets, 1.0, vocab_size=50)
    got = fused_log_probs(hidden, weight, targets, vocab_size=50, chunk_tokens=5)
    exact = _exact(hidden, weight, targets, 1.0, vocab_size=50)
    for name, a, b, dense in zip(("log_prob", "entropy"), got, exact, ref):
        _close_rows(a, b, F64_BOUND * max(1.0, b.abs().max().item()), name, dense)


def test_float32_within_rounding_bound_of_float64():
    hidden, weight, targets = _inputs(n=64, h=64, v=3000, dtype=torch.float64, scale=1.0)
    temperature = 0.6
    ref_lp, ref_ent = _dense(hidden, weight, targets, temperature)
    lp, ent = fused_log_probs(hidden.float(), weight.float(), targets, temperature, chunk_tokens=7)
    h_dim, v_dim = hidden.shape[1], weight.shape[0]
    gamma = h_dim * FP32_EPS / (1 - h_dim * FP32_EPS)
    # the inputs are rounded to fp32 too: one more relative u per product term
    dz = ((gamma + 2 * FP32_EPS) * (hidden.abs() @ weight.abs().t()) / temperature).max(-1).values
    z = hidden @ weight.t() / temperature
    spread = (z.max(-1).values - z.min(-1).values).abs()
    sums = (v_dim + 8) * FP32_EPS * (1 + spread + ref_lp.abs())
    for name, a, b in (("log_prob", lp, ref_lp), ("entropy", ent, ref_ent)):
        err = (a.double() - b).abs()
        bound = 2 * dz + sums
        assert (err <= bound).all(), (name, (err - bound).max().item())


def test_dense_path_is_the_same_function():
    hidden, weight, targets = _inputs(dtype=torch.float32)
    logits = hidden @ weight.t()
    lp, ent = dense_log_probs(logits, targets, 0.9, entropy_grad=False)
    ref = _dense(hidden.double(), weight.double(), targets, 0.9)
    _close(lp, ref[0], 1e-4, "log_prob")
    _close(ent, ref[1], 1e-4, "entropy")


def test_chunk_size_from_budget():
    assert chunk_size(151936) == 128 * 2**20 // (4 * 151936)
    assert chunk_size(10**9, chunk_bytes=16) == 1


def test_rejects_nonpositive_temperature():
    hidden, weight, targets = _inputs()
    with pytest.raises(ValueError, match="--rollout-temperature"):
        fused_log_probs(hidden, weight, targets, 0.0)


def _tp_worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {}
        for vocab_size in TP_VOCAB_SIZES:
            hidden, weight, targets = _inputs(v=64)  # padded: 64 rows, vocab_size real
            targets = targets % vocab_size
            shard = weight.chunk(world)[rank]
            g = torch.Generator().manual_seed(5)
            g_lp = torch.randn(hidden.shape[0], generator=g, dtype=torch.float64)
            g_ent = torch.randn(hidden.shape[0], generator=g, dtype=torch.float64)
            for entropy_grad in (True, False):  # without: the log-prob-only backward
                results[vocab_size, entropy_grad] = _grads(
                    lambda h, w, v=vocab_size, t=targets, e=entropy_grad: fused_log_probs(
                        h,
                        w,
                        t,
                        0.8,
                        vocab_size=v,
                        group=dist.group.WORLD,
                        chunk_tokens=6,
                        entropy_grad=e,
                    ),
                    hidden,
                    shard,
                    g_lp,
                    g_ent,
                )
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


#: 50 of 64 rows real (rank 1's shard part padding); 30 (rank 1's shard all padding)
TP_VOCAB_SIZES = (50, 30)


def test_tensor_parallel_vocab_shards_equal_dense(tmp_path):
    """TP=2 on gloo: each rank holds half the (padded) vocabulary; the values and the hidden
    states' gradient are the dense ones on both ranks, each rank's weight gradient is its
    shard's rows of the dense one (the padding rows' gradient is zero)."""
    world = 2
    ctx = rank_context()
    port = free_port()
    procs = [
        ctx.Process(target=in_environ(_tp_worker), args=(r, world, port, str(tmp_path)))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(scaled(120))
        assert p.exitcode == 0
    for vocab_size, entropy_grad in itertools.product(TP_VOCAB_SIZES, (True, False)):
        hidden, weight, targets = _inputs(v=64)
        targets = targets % vocab_size
        g = torch.Generator().manual_seed(5)
        g_lp = torch.randn(hidden.shape[0], generator=g, dtype=torch.float64)
        g_ent = torch.randn(hidden.shape[0], generator=g, dtype=torch.float64)
        ref = _grads(
            lambda h, w, v=vocab_size, t=targets: _dense(h, w, t, 0.8, v),
            hidden,
            weight,
            g_lp,
            g_ent if entropy_grad else torch.zeros_like(g_ent),
        )
        for rank in range(world):
            lp, ent, gh, gw = torch.load(tmp_path / f"rank{rank}.pt")[vocab_size, entropy_grad]
            label = f"V={vocab_size} entropy_grad={entropy_grad} rank{rank}"
            for name, a, b in (
                ("log_prob", lp, ref[0]),
                ("entropy", ent, ref[1]),
                ("gh", gh, ref[2]),
            ):
                _close(a, b, F64_BOUND * max(1.0, b.abs().max().item()), f"{label} {name}")
            rows = ref[3].chunk(world)[rank]
            _close(gw, rows, F64_BOUND * max(1.0, ref[3].abs().max().item()), f"{label} gw")


def test_bf16_weight_gradient_is_no_worse_than_the_dense_path():
    """16-bit weights: each chunk's dW product runs on bf16 operands (as the dense path's
    autograd does) and is summed in float32. Against float64, its error stays within twice the
    dense bf16 path's (a float32 product would be better; an unscaled or dropped chunk would be
    O(1) off)."""
    hidden, weight, targets = _inputs(n=96, h=32, v=300, dtype=torch.float64, scale=1.0)
    g_lp = torch.randn(96, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    g_ent = torch.randn(96, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    hb, wb = hidden.bfloat16(), weight.bfloat16()
    *_, gw_ref = _grads(
        lambda h, w: _dense(h, w, targets, 0.7), hb.double(), wb.double(), g_lp, g_ent
    )

    def dense_bf16(h, w):
        return dense_log_probs(h @ w.t(), targets, 0.7, entropy_grad=True)

    def fused_bf16(h, w):
        return fused_log_probs(h, w, targets, 0.7, chunk_tokens=17)

    *_, gw_dense = _grads(dense_bf16, hb, wb, g_lp.float(), g_ent.float())
    *_, gw_fused = _grads(fused_bf16, hb, wb, g_lp.float(), g_ent.float())
    assert gw_fused.dtype == torch.bfloat16
    err_dense = (gw_dense.double() - gw_ref).abs().max().item()
    err_fused = (gw_fused.double() - gw_ref).abs().max().item()
    assert 0 < err_fused <= 2 * err_dense, (err_fused, err_dense)
