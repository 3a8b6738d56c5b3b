"""``--true-on-policy`` on CPU: ops whose per-token result does not depend on the batch.

The engine and the trainer compute the same tokens in different shapes: the engine prefills a
left-padded batch and decodes one token per row against a KV cache; the trainer runs the
samples packed into one row, position ids restarting at each sample. A kernel that splits a
reduction by the shape it is given (a GEMM's blocking, a thread split) gives the same token
different roundings in the two. Within :func:`mode`, every op whose result for one token could
depend on the others is computed by one fixed computation of that token alone:

- :func:`linear` (``F.linear``: every projection and the output head): output row ``i`` is
  ``(W * x_i).sum(-1)``, an elementwise product and a reduction over the contiguous input
  dimension of a ``[out, in]`` tensor, for each row alone. The reduction's order depends only
  on that shape, never on how many rows the call carries, and no BLAS kernel (whose blocking
  and alignment paths vary) is involved. Differentiable (autograd sees the ops).
- :func:`attention` (transformers' attention-function contract, registered as
  :data:`HF_ATTENTION_NAME` by :func:`register_hf`): each query attends to the keys its boolean
  mask allows, gathered into a contiguous ``[n, D]`` block, with the same three steps (scores,
  softmax, weighted sum) for that query alone. A prefill, a decode step against the cache (left
  padding masked) and a packed training row (block-diagonal mask) give the same ``n`` keys in
  the same order, hence the same numbers.
- one intra-op thread (:func:`mode` sets it), so no reduction is split by a thread count.

RMSNorm, softmax and ``log_softmax`` reduce each row over its last dimension; with one thread
their per-row results are batch-invariant on CPU as they are (tests/miles_core/
test_batch_invariant.py checks it), so the mode leaves them to torch. Both sides scale the
logits by ``1 / T`` and take ``log_softmax`` in float32 through one function,
:func:`miles_core.log_probs.scaled_log_softmax` (the engine's sampler; the trainer's fused head,
:mod:`miles_core.batch_invariant_head`, a chunk of tokens at a time, or
:func:`miles_core.log_probs.token_log_probs` over materialised logits).

On a GPU (the tensors on CUDA, bf16 or fp32) the same four ops run as Triton kernels of
:mod:`miles_native.kernels.batch_invariant`, whose row results do not depend on the batch,
padding or pack either: ``F.linear`` (fixed tiles, no split-K), the attention (one program per
tile of queries and a head, each query over its contiguous key range in blocks counted from its
first key), the
``mean`` over the last dimension (RMSNorm's variance: the mode takes ``x.mean(-1)`` of a CUDA
tensor) and the temperature-scaled ``log_softmax`` (torch divides a CUDA tensor by a Python
float as a multiplication by its reciprocal, but by a tensor of temperatures exactly: the kernel
divides both alike). The kernels come from the miles-native package, imported when the mode
first meets a CUDA tensor. A packed training row (transformers passes the trainer's
``cu_seq_lens_q``) takes its key spans from those boundaries on the device and its backward from
torch's varlen flash kernel (:func:`packed_attention`): one launch per layer for the whole row,
nothing read back to the host; the engine's prefill and decode spans come from their masks.

The CPU path is for correctness in float32; it is slow (a Python loop over rows and queries).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from types import ModuleType

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from miles_core.varlen_attention import varlen_causal_attention

#: The ``attn_implementation`` name both sides load their HF model with in the mode.
HF_ATTENTION_NAME = "miles_batch_invariant"
#: What the mode sets ``torch.set_num_threads`` to.
NUM_THREADS = 1
_state = threading.local()
#: The dtypes the GPU kernels compute in.
_GPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _gpu() -> ModuleType:
    """The GPU kernels (:mod:`miles_native.kernels.batch_invariant`), one line if absent."""
    try:
        # optional: miles-native's Triton kernels, needed only on a GPU
        from miles_native.kernels import batch_invariant as kernels
    except ImportError as exc:
        raise RuntimeError(
            f"--true-on-policy on a GPU needs the miles-native package's Triton kernels ({exc})"
        ) from exc
    return kernels


def active() -> bool:
    """Whether this thread is inside :func:`mode`."""
    return getattr(_state, "depth", 0) > 0


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` computed one row at a time by the same reduction (see the module doc); on
    CUDA the GPU kernel."""
    if x.is_cuda:
        return _gpu().linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    out = [(weight * rows[i]).sum(-1) for i in range(rows.shape[0])]
    y = torch.stack(out) if out else rows.new_empty(0, weight.shape[0])
    y = y.reshape(*x.shape[:-1], weight.shape[0])
    return y + bias if bias is not None else y.clone()  # a tensor of its own, not a view


def linear_values(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`linear`'s values without a graph (``x @ weight.T``, each row alone)."""
    if x.is_cuda:
        return _gpu().linear_forward(x, weight)
    with torch.no_grad():
        return linear(x, weight)


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention contract: ``query`` ``(B, H, Tq, D)``, ``key``/``value``
    ``(B, Hkv, Tk, D)``, ``attention_mask`` boolean ``(B, 1, Tq, Tk)`` (True: attend); returns
    ``(B, Tq, H, D)``. A query whose mask allows no key (padding) gets zeros."""
    if attention_mask is None or attention_mask.dtype != torch.bool or attention_mask.dim() != 4:
        raise ValueError(
            f"attn_implementation {HF_ATTENTION_NAME!r} needs a boolean 4-D attention mask"
        )
    if dropout or kwargs.get("sliding_window") is not None:
        raise ValueError(f"attn_implementation {HF_ATTENTION_NAME!r} has no dropout or window")
    batch, heads, q_len, dim = query.shape
    group = heads // key.shape[1]
    scale = dim**-0.5 if scaling is None else scaling
    if query.is_cuda:
        cu = kwargs.get("cu_seq_lens_q")
        if cu is not None and batch == 1 and key.shape[2] == q_len:
            return packed_attention(query, key, value, cu, kwargs["max_length_q"], scale), None
        return _gpu().attention(query, key, value, attention_mask, scale), None
    out = query.new_zeros(batch, q_len, heads, dim)
    for b in range(batch):
        k_b = key[b].repeat_interleave(group, dim=0)  # (H, Tk, D)
        v_b = value[b].repeat_interleave(group, dim=0)
        mask_b = attention_mask[b, 0] if attention_mask.shape[0] > 1 else attention_mask[0, 0]
        for i in range(q_len):
            keep = mask_b[i].nonzero().squeeze(-1)
            if keep.numel() == 0:
                continue
            k, v = k_b[:, keep], v_b[:, keep]  # (H, n, D), contiguous copies
            scores = (k * query[b, :, i, None, :]).sum(-1) * scale  # (H, n)
            probs = torch.softmax(scores, dim=-1)
            out[b, i] = (probs[..., None] * v).sum(1)
    return out, None


#: ``(cu_seqlens, its version, its spans)`` of the last packed row: every layer of a forward gets
#: the same ``cu_seq_lens_q`` tensor, so its spans are computed once.
_last_packed: tuple[torch.Tensor, int, tuple[torch.Tensor, torch.Tensor]] | None = None


def packed_spans(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(start, end)`` int32 ``[1, total]`` of a packed row's block-diagonal causal attention:
    query ``t`` of the sample ``[cu[i], cu[i+1])`` attends to keys ``[cu[i], t]``. The spans the
    row's boolean mask gives (:func:`miles_core.packing.block_causal_mask`), computed on the
    device from the boundaries alone (no ``T x T`` pass, nothing read back to the host)."""
    global _last_packed
    last = _last_packed
    if last is not None and last[0] is cu_seqlens and last[1] == cu_seqlens._version:
        return last[2]
    cu = cu_seqlens.to(torch.int32)
    pos = torch.arange(total, device=cu.device, dtype=torch.int32)
    sample = torch.searchsorted(cu[1:], pos, right=True).clamp_(max=cu.numel() - 1)
    spans = (cu[sample][None].contiguous(), (pos + 1)[None].contiguous())
    _last_packed = (cu_seqlens, cu_seqlens._version, spans)
    return spans


class _PackedAttention(torch.autograd.Function):
    """A packed row's attention: the batch-invariant kernel's forward over :func:`packed_spans`;
    the backward is :func:`miles_core.varlen_attention.varlen_causal_attention`'s (torch's varlen
    flash kernel on a GPU: one launch for the whole row, the boundaries a device tensor)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, scale):
        start, end = packed_spans(cu_seqlens, q.shape[2])
        ctx.save_for_backward(q, k, v, cu_seqlens)
        ctx.max_seqlen, ctx.scale = max_seqlen, scale
        return _gpu().attention_forward(q, k, v, start, end, scale)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, cu_seqlens = ctx.saved_tensors
        with torch.enable_grad():
            # (1, H, T, D) -> (T, H, D): transformers' q/k/v are views of (1, T, H, D) tensors
            q_, k_, v_ = (t[0].transpose(0, 1).detach().requires_grad_(True) for t in (q, k, v))
            y = varlen_causal_attention(q_, k_, v_, cu_seqlens, ctx.max_seqlen, ctx.scale)
            gq, gk, gv = torch.autograd.grad(y, (q_, k_, v_), grad[0])
        return (*(g.transpose(0, 1)[None] for g in (gq, gk, gv)), None, None, None)


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
) -> torch.Tensor:
    """Batch-invariant attention of one packed row (``q`` ``(1, H, T, D)``, ``k``/``v``
    ``(1, Hkv, T, D)``) whose samples end at ``cu_seqlens``; ``(1, T, H, D)``. The forward values
    are the kernel's under the row's block-diagonal mask (the same bits as
    :func:`miles_native.kernels.batch_invariant.attention` with that mask)."""
    return _PackedAttention.apply(q, k, v, cu_seqlens, max_seqlen, scale)


def _last_dim_mean(args: tuple, kwargs: dict) -> bool | None:
    """``keepdim`` when ``torch.mean(x, -1[, keepdim])`` is a mean over a CUDA tensor's last
    dimension (RMSNorm's variance), else None."""
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, torch.Tensor) or not x.is_cuda or x.dtype not in _GPU_DTYPES:
        return None
    if x.dim() == 0 or kwargs.get("dtype") is not None or kwargs.get("out") is not None:
        return None
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if isinstance(dim, (tuple, list)) and len(dim) == 1:
        dim = dim[0]
    if not isinstance(dim, int) or dim not in (-1, x.dim() - 1):
        return None
    return bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))


class _Mode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return linear(*args, **kwargs)
        if func is torch.mean or func is torch.Tensor.mean:
            keepdim = _last_dim_mean(args, kwargs)
            if keepdim is not None:
                x = args[0] if args else kwargs["input"]
                return _gpu().row_mean(x, keepdim=keepdim)
        return func(*args, **kwargs)


def log_softmax(logits: torch.Tensor, temperature: torch.Tensor | float) -> torch.Tensor:
    """``log_softmax(logits.float() / temperature, -1)`` of CUDA logits by the GPU kernel
    (``temperature`` one float or one per row)."""
    return _gpu().log_softmax(logits, temperature)


@contextlib.contextmanager
def mode() -> Iterator[None]:
    """Within (on this thread): ``F.linear`` is :func:`linear`, a CUDA tensor's last-dim
    ``mean`` the GPU kernel's, one intra-op thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(NUM_THREADS)
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        with _Mode():
            yield
    finally:
        _state.depth -= 1
        torch.set_num_threads(threads)


def _mask(*args, **kwargs):
    # optional: transformers is not a miles-core dependency (its callers load HF models)
    from transformers.masking_utils import sdpa_mask

    # always the boolean 4-D mask, never None for "plain causal": attention() reads it
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register_hf() -> str:
    """Register :func:`attention` (and a mask function that always builds the boolean mask)
    with transformers under :data:`HF_ATTENTION_NAME`; returns the name."""
    # optional: transformers is not a miles-core dependency (its callers load HF models)
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(HF_ATTENTION_NAME, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(HF_ATTENTION_NAME, _mask)
    return HF_ATTENTION_NAME
