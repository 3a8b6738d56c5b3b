"""The fused log-prob head in the ``--true-on-policy`` mode (miles_core.batch_invariant_head).

* Its log-probs are the dense path's in the mode (the engine's computation: the mode's linear,
  then ``scaled_log_softmax``), bit for bit, with the tokens split into several chunks (each
  row's arithmetic does not depend on its chunk).
* Its backward is the gradient of ``log_softmax(h W^T / T)``: with the chunk's forward computed
  in float64 (the kernels replaced by plain float64 torch, so only the hand-written backward is
  under test), the gradients equal torch's float64 autograd through the dense softmax to a few
  hundred float64 roundings (an algebra mistake, a missing ``1 / T`` or entropy term, is O(1)).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from miles_core import batch_invariant, batch_invariant_head
from miles_core.log_prob_head import fused_log_probs
from miles_core.log_probs import entropy_from_logits, token_log_probs

pytestmark = pytest.mark.numeric

F64_BOUND = 2.0**-52 * 512


def _inputs(n=23, h=16, v=57, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 2).to(dtype)
    weight = torch.randn(v, h, generator=g).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


def test_log_probs_are_the_dense_mode_path_bit_for_bit(monkeypatch):
    hidden, weight, targets = _inputs()
    chunks = []
    real = batch_invariant_head._chunk_log_softmax
    monkeypatch.setattr(
        batch_invariant_head,
        "_chunk_log_softmax",
        lambda h, w, t: chunks.append(h.shape[0]) or real(h, w, t),
    )
    with batch_invariant.mode():
        lp, ent = fused_log_probs(hidden, weight, targets, 0.7, chunk_tokens=5)
        logits = F.linear(hidden, weight)  # the engine's head
        dense_lp = token_log_probs(logits, targets, 0.7)
        dense_ent = entropy_from_logits(logits, 0.7)
    assert chunks == [5, 5, 5, 5, 3]  # the mode's head ran, over several chunks
    assert torch.equal(lp, dense_lp)
    # the entropy's row reductions are batch-invariant on CPU with the mode's one thread too
    assert torch.equal(ent, dense_ent)
    # outside the mode the fused head is the cuBLAS/BLAS one: it rounds differently
    plain, _ = fused_log_probs(hidden, weight, targets, 0.7, chunk_tokens=5)
    assert not torch.equal(plain, lp)


def _float64_chunk(h, w, t):
    return torch.log_softmax((h.double() @ w.double().t()) / t, -1)


@pytest.mark.parametrize("entropy_grad", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_float64_gradients_equal_autograd_through_the_dense_softmax(
    monkeypatch, temperature, entropy_grad
):
    monkeypatch.setattr(batch_invariant_head, "_chunk_log_softmax", _float64_chunk)
    hidden, weight, targets = _inputs(dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    g_lp, g_ent = torch.randn(2, hidden.shape[0], generator=g, dtype=torch.float64)

    def grads(fn):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, ent = fn(h, w)
        loss = (lp * g_lp).sum()
        if entropy_grad:
            loss = loss + (ent * g_ent).sum()
        loss.backward()
        return h.grad, w.grad

    def dense(h, w):
        log_p = torch.log_softmax(h @ w.t() / temperature, -1)
        return log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)

    def head(h, w):
        lp, ent = batch_invariant_head.log_probs(h, w, targets, temperature, 4, entropy_grad)
        return lp.double(), ent.double()

    for name, got, want in zip(("grad_h", "grad_w"), grads(head), grads(dense)):
        err = (got - want).abs().max().item()
        assert err <= F64_BOUND * max(1.0, want.abs().max().item()), (name, err)


def test_backward_on_another_thread_recomputes_in_the_mode(monkeypatch):
    """On a GPU autograd runs the backward on its device thread, outside the forward's
    thread-local mode: the recompute must enter the mode itself (else its log-softmax is torch's,
    not the kernel the forward used)."""
    import threading

    hidden, weight, targets = _inputs()
    hidden.requires_grad_(True)
    seen = []
    real = batch_invariant_head._chunk_log_softmax

    def chunk(h, w, t):
        seen.append((threading.get_ident(), batch_invariant.active()))
        return real(h, w, t)

    monkeypatch.setattr(batch_invariant_head, "_chunk_log_softmax", chunk)
    with batch_invariant.mode():
        lp, _ = fused_log_probs(hidden, weight, targets, 0.7, chunk_tokens=5)
    forward = list(seen)
    seen.clear()
    worker = threading.Thread(target=lambda: lp.sum().backward())
    worker.start()
    worker.join()
    assert len(forward) == 5 and all(active for _, active in forward)
    assert len(seen) == 5, seen  # the backward recomputed every chunk ...
    main = threading.get_ident()
    assert all(thread != main and active for thread, active in seen), seen  # ... in the mode
    assert hidden.grad is not None and hidden.grad.abs().max() > 0
