"""Per-token log-probs and entropies straight from hidden states, without the ``[T, V]`` logits.

:func:`fused_log_probs` takes the final norm's output ``h`` ``[..., H]``, the output projection
``W`` ``[V, H]`` (``lm_head``, the tied embedding, or one tensor-parallel rank's vocabulary
shard), the target token of every position and the sampling temperature ``T``; it returns, in
float32 (float64 when ``h`` is),

* ``log_prob = log softmax(h W^T / T)[target]`` and
* ``entropy = -sum_v p_v log p_v`` with ``p = softmax(h W^T / T)``,

computing ``h W^T`` a chunk of tokens at a time (``chunk_tokens``, or as many tokens as fit
``chunk_bytes`` of float32 logits): no ``[T, V]`` tensor ever exists. Per chunk, with
``z = h W^T / T`` and its row maximum ``m``: ``s = sum exp(z - m)``, ``lse = m + log s``,
``log_prob = z_target - lse`` and ``entropy = log s - sum exp(z - m) (z - m) / s`` (both from the
shifted ``z - m``, so a peaked row loses nothing to cancellation). Backward recomputes each
chunk's ``z`` and uses ``d log_prob / dz = onehot(target) - p`` and
``d entropy / dz = -p (z - E_p[z])``, then ``dh = dz W / T`` and ``dW += dz^T h / T``; the
weight's gradient accumulates in float32 (the weight's dtype when that is float32).

Tensor parallelism (``group``): ``W`` is this rank's contiguous shard of the (padded)
vocabulary, rows ``[rank * V_local, (rank + 1) * V_local)``; ``h`` and ``targets`` are the same
on every rank of ``group``. The row maximum is all-reduced (max), ``s``, ``sum exp(z-m)(z-m)``
and the target's logit (held by one rank) are all-reduced (sum): three small ``[chunk]``
collectives a chunk, never a gather of logits. In backward ``dh`` is all-reduced (sum) over the
group, so the caller gets the full gradient of its replicated ``h``. ``vocab_size`` drops padded
vocabulary rows (global index >= ``vocab_size``). Context parallelism composes by construction:
it only changes which tokens a rank holds, and every token is independent here.

Within :func:`miles_core.batch_invariant.mode` (``--true-on-policy``) the chunks are computed
by :mod:`miles_core.batch_invariant_head`: the engine's batch-invariant linear and
``log_softmax``, whose row values do not depend on the chunk.

:func:`dense_log_probs` is the same quantity from materialised logits (the debug path,
``--no-fused-log-probs``), and the reference the tests compare against.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from miles_core import batch_invariant, batch_invariant_head
from miles_core.log_probs import entropy_from_logits, token_log_probs

#: Float32 logits of one chunk: 128 MiB, i.e. ~220 tokens at a 151,936-token vocabulary.
DEFAULT_CHUNK_BYTES = 128 * 2**20
#: On a GPU: 512 MiB (~880 tokens at 151,936), so each chunk's matmuls are large enough for the
#: tensor cores and the per-chunk launches stay few; the chunk's float32 temporaries (about four
#: times this) stay well under the dense path's ``[T, V]`` tensors at the token counts that matter.
CUDA_CHUNK_BYTES = 512 * 2**20


def chunk_size(vocab_local: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk so that one chunk's float32 logits fit ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * max(vocab_local, 1)))


MAX = dist.ReduceOp.MAX


def _all_reduce(t: torch.Tensor, group: Any, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, temperature: float) -> torch.Tensor:
    z = (h @ w.t()).to(_compute_dtype(h))  # a new tensor either way
    if temperature != 1.0:
        z.div_(temperature)
    return z


class _FusedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, vocab_start, group, chunk, entropy_grad):
        n = hidden.shape[0]
        vocab_local = weight.shape[0]
        dtype = _compute_dtype(hidden)
        lp = hidden.new_empty(n, dtype=dtype)
        ent = hidden.new_empty(n, dtype=dtype)
        shift = hidden.new_empty(n, dtype=dtype)  # log s
        mean_z = hidden.new_empty(n, dtype=dtype)  # E_p[z - m]
        row_max = hidden.new_empty(n, dtype=dtype)
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            if vocab_local == 0:  # a TP rank whose shard is all padding: joins the reductions
                m = _all_reduce(hidden.new_full((b - a,), -torch.inf, dtype=dtype), group, MAX)
                zt = _all_reduce(hidden.new_zeros(b - a, dtype=dtype), group)
                sums = _all_reduce(hidden.new_zeros(2, b - a, dtype=dtype), group)
                log_s = sums[0].log()
                ez = sums[1] / sums[0]
                lp[a:b], ent[a:b], row_max[a:b], shift[a:b], mean_z[a:b] = (
                    zt - log_s,
                    log_s - ez,
                    m,
                    log_s,
                    ez,
                )
                continue
            z = _chunk_logits(hidden[a:b], weight, temperature)
            m = _all_reduce(z.max(dim=-1).values, group, MAX)
            z.sub_(m.unsqueeze(-1))  # z - m, in place
            local_t = targets[a:b] - vocab_start
            held = (local_t >= 0) & (local_t < vocab_local)
            zt = z.gather(-1, local_t.clamp(0, vocab_local - 1).unsqueeze(-1)).squeeze(-1)
            zt = _all_reduce(torch.where(held, zt, torch.zeros_like(zt)), group)
            e = z.exp()
            sums = _all_reduce(torch.stack([e.sum(-1), (e * z).sum(-1)]), group)
            log_s = sums[0].log()
            ez = sums[1] / sums[0]
            lp[a:b] = zt - log_s
            ent[a:b] = log_s - ez
            row_max[a:b] = m
            shift[a:b] = log_s
            mean_z[a:b] = ez
            del z, e
        ctx.save_for_backward(hidden, weight, targets, row_max, shift, mean_z)
        ctx.temperature = temperature
        ctx.vocab_start = vocab_start
        ctx.group = group
        ctx.chunk = chunk
        ctx.entropy_grad = entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(ent)
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        hidden, weight, targets, row_max, log_s, mean_z = ctx.saved_tensors
        if not ctx.entropy_grad:
            grad_ent = None  # a metric-only entropy (its slot of a stacked output): no work
        if grad_lp is None and grad_ent is None:
            return None, None, None, None, None, None, None, None
        temperature, group, chunk = ctx.temperature, ctx.group, ctx.chunk
        n = hidden.shape[0]
        vocab_local = weight.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = None
        if need_w:
            grad_w = torch.zeros(weight.shape, dtype=_compute_dtype(weight), device=weight.device)
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            if vocab_local == 0:  # an all-padding shard contributes nothing to dh
                if need_h:
                    grad_h[a:b] = 0
                continue
            z = _chunk_logits(hidden[a:b], weight, temperature)
            local_t = targets[a:b] - ctx.vocab_start
            held = (local_t >= 0) & (local_t < vocab_local)
            # rows whose target is another rank's add an exact zero at a clamped column
            # (no nonzero(): it would make the host wait for the device)
            columns = local_t.clamp(0, vocab_local - 1).long().unsqueeze(-1)
            if grad_ent is None:  # the common case: g (onehot - p) / T, in place in z
                g = grad_lp[a:b].to(z.dtype) / temperature
                dz = z.sub_((row_max[a:b] + log_s[a:b]).unsqueeze(-1)).exp_().mul_(-g.unsqueeze(-1))
                dz.scatter_add_(1, columns, (g * held.to(g.dtype)).unsqueeze(-1))
            else:
                z.sub_(row_max[a:b].unsqueeze(-1))  # z - m
                p = (z - log_s[a:b].unsqueeze(-1)).exp_()  # softmax
                # -g_H p (z - E[z])
                dz = z.sub_(mean_z[a:b].unsqueeze(-1)).mul_(p).mul_(-grad_ent[a:b].unsqueeze(-1))
                if grad_lp is not None:  # g (onehot - p)
                    g = grad_lp[a:b].to(dz.dtype).unsqueeze(-1)
                    dz.sub_(p.mul_(g))
                    dz.scatter_add_(1, columns, g * held.unsqueeze(-1).to(g.dtype))
                del p
                if temperature != 1.0:
                    dz.div_(temperature)
            del z
            # one cast of the chunk serves both products: 16-bit weights multiply 16-bit operands
            # (the tensor cores, as the dense path's autograd) and dW is summed in float32
            operand = dz.to(weight.dtype)
            if need_h:
                grad_h[a:b] = (operand @ weight).to(hidden.dtype)
            if need_w:
                grad_w.add_(operand.t() @ hidden[a:b].to(weight.dtype))
            del dz, operand
        if need_h:
            _all_reduce(grad_h, group)
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None, None


def fused_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    vocab_size: int | None = None,
    group: Any = None,
    chunk_tokens: int | None = None,
    chunk_bytes: int | None = None,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_probs, entropy)``, float32 (float64 for float64 inputs) ``hidden.shape[:-1]``, of ``softmax(hidden @ weight.T /
    temperature)`` at ``targets``, chunk by chunk over tokens (module docstring).

    ``weight``: ``[V_local, H]``, this rank's vocabulary shard under ``group`` (tensor
    parallelism) or the whole output projection; ``vocab_size``: the real vocabulary (rows past
    it are padding and take no probability). Without ``entropy_grad`` the entropy is a metric:
    it carries no gradient, and the backward computes none for it.
    """
    if temperature <= 0:
        raise ValueError(f"--rollout-temperature must be > 0 for log-probs, got {temperature}")
    rank = dist.get_rank(group) if group is not None and dist.get_world_size(group) > 1 else 0
    vocab_start = rank * weight.shape[0]
    if vocab_size is not None:
        weight = weight[: max(0, min(weight.shape[0], vocab_size - vocab_start))]
    shape = hidden.shape[:-1]
    if chunk_bytes is None:
        chunk_bytes = CUDA_CHUNK_BYTES if hidden.is_cuda else DEFAULT_CHUNK_BYTES
    chunk = chunk_tokens or chunk_size(weight.shape[0], chunk_bytes)
    if batch_invariant.active():  # --true-on-policy: the engine's forward values
        if group is not None and dist.get_world_size(group) > 1:
            raise ValueError("--true-on-policy scores with the whole vocabulary on one rank")
        lp, ent = batch_invariant_head.log_probs(
            hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), temperature,
            chunk, entropy_grad,
        )  # fmt: skip
        return lp.reshape(shape), ent.reshape(shape)
    lp, ent = _FusedLogProbs.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        targets.reshape(-1).long(),
        float(temperature),
        vocab_start,
        group,
        chunk,
        entropy_grad,
    )
    return lp.reshape(shape), ent.reshape(shape)


def dense_log_probs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_probs, entropy)`` from materialised logits (the ``--no-fused-log-probs`` path).

    Without ``entropy_grad`` the entropy is a metric and keeps no graph through the
    full-vocabulary softmax."""
    log_probs = token_log_probs(logits, targets, temperature)
    if entropy_grad:
        return log_probs, entropy_from_logits(logits, temperature)
    with torch.no_grad():
        return log_probs, entropy_from_logits(logits.detach(), temperature)
