"""The fused log-prob head under ``--true-on-policy``: the engine's log-probs, a chunk at a time.

The engine scores a token as ``scaled_log_softmax(h W^T, T)[target]``: the batch-invariant
linear (:func:`miles_core.batch_invariant.linear`) gives the logits in the compute dtype, and
:func:`miles_core.log_probs.scaled_log_softmax` takes their temperature-scaled ``log_softmax``
in float32. Both compute each row alone, with an arithmetic that does not depend on how many
rows the call carries, so computing them for a chunk of tokens at a time gives the same bits as
for the whole row at once: :func:`log_probs` is the fused head of
:mod:`miles_core.log_prob_head` (no ``[T, V]`` tensor: the dense path's bf16 logits, float32
log-softmax, its gradient and their temporaries are several times ``T x V x 4`` bytes, which at
the Qwen3 vocabulary and ~10k tokens make the GPU's caching allocator free and re-allocate
memory, each free a device synchronisation) with the mode's forward values.

Per chunk of tokens, with ``s = h W^T / T`` and ``log p = log_softmax(s)``:

* ``log_prob = log p[target]``, ``entropy = -sum_v p_v log p_v`` (float32; float64 for float64 inputs);
* backward recomputes the chunk's ``log p`` by the same two calls in the mode (so ``p`` is the
  forward's, on whichever thread autograd runs the backward),
  ``d/ds log_prob = onehot(target) - p``, ``d/ds entropy = -p (log p + entropy)``, then
  ``dz = ds / T``, ``dh = dz W`` and ``dW += dz^T h`` (plain matmuls: only forward values must
  agree with the engine), the weight's gradient summed in float32.

Its tests: tests/miles_core/test_batch_invariant_head.py (bitwise equal to the dense path in the
mode, gradients against float64).
"""

from __future__ import annotations

import torch

from miles_core import batch_invariant
from miles_core.log_probs import scaled_log_softmax


def _chunk_log_softmax(h: torch.Tensor, w: torch.Tensor, temperature: float) -> torch.Tensor:
    # no graph: linear_values keeps none, and the Function computes the backward itself
    return scaled_log_softmax(batch_invariant.linear_values(h, w), temperature)


class _BatchInvariantLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, entropy_grad):
        n = hidden.shape[0]
        dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        lp, ent = hidden.new_empty(2, n, dtype=dtype)
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            log_p = _chunk_log_softmax(hidden[a:b], weight, temperature)
            lp[a:b] = log_p.gather(-1, targets[a:b, None]).squeeze(-1)
            ent[a:b] = (log_p.exp() * log_p).sum(-1).neg_()
            del log_p
        ctx.save_for_backward(hidden, weight, targets, ent)
        ctx.temperature, ctx.chunk, ctx.entropy_grad = temperature, chunk, entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(ent)
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        hidden, weight, targets, ent = ctx.saved_tensors
        if not ctx.entropy_grad:
            grad_ent = None  # a metric-only entropy: no work
        if grad_lp is None and grad_ent is None:
            return None, None, None, None, None, None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = None
        if need_w:  # summed in float32 (float64 for a float64 weight)
            acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
            grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        n = hidden.shape[0]
        for a in range(0, n, ctx.chunk):
            b = min(a + ctx.chunk, n)
            # in the mode again: on a GPU the backward runs on autograd's device thread,
            # outside the forward's (thread-local) mode, where the log-softmax would be torch's
            with batch_invariant.mode():
                log_p = _chunk_log_softmax(hidden[a:b], weight, ctx.temperature)
            p = log_p.exp()
            g_lp = grad_lp[a:b, None].to(p.dtype) if grad_lp is not None else None
            if grad_ent is not None:  # -g_H p (log p + H), in place in log p
                ds = log_p.add_(ent[a:b, None]).mul_(p).mul_(-grad_ent[a:b, None].to(p.dtype))
                if g_lp is not None:
                    ds.sub_(p.mul_(g_lp))
            else:
                ds = p.mul_(-g_lp)
            if g_lp is not None:  # + g onehot(target): with the - g p above, g (onehot - p)
                ds.scatter_add_(1, targets[a:b, None], g_lp)
            del p, log_p
            operand = ds.div_(ctx.temperature).to(weight.dtype)
            del ds
            if need_h:
                grad_h[a:b] = (operand @ weight).to(hidden.dtype)
            if need_w:
                grad_w.add_(operand.t() @ hidden[a:b].to(weight.dtype))
            del operand
        return grad_h, grad_w.to(weight.dtype) if need_w else None, None, None, None, None


def log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk: int,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_probs, entropy)`` float32 ``[N]`` of ``hidden`` ``[N, H]`` under ``weight``
    ``[V, H]`` at ``targets`` ``[N]``, ``chunk`` tokens at a time, with the forward values of
    the mode's dense path (module doc)."""
    return _BatchInvariantLogProbs.apply(
        hidden, weight, targets.long(), float(temperature), chunk, entropy_grad
    )
