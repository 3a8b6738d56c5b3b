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
logits by ``1 / T`` and take ``log_softmax`` in float32 (:func:`miles_core.log_probs.
token_log_probs` and the engine's sampler).

The mode is for correctness on CPU in float32; it is slow (a Python loop over rows and
queries). There are no batch-invariant GPU kernels yet: :func:`refuse_cuda` says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

#: The ``attn_implementation`` name both sides load their HF model with in the mode.
HF_ATTENTION_NAME = "miles_batch_invariant"
#: What the mode sets ``torch.set_num_threads`` to.
NUM_THREADS = 1


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` computed one row at a time by the same reduction (see the module doc)."""
    rows = x.reshape(-1, x.shape[-1])
    out = [(weight * rows[i]).sum(-1) for i in range(rows.shape[0])]
    y = torch.stack(out) if out else rows.new_empty(0, weight.shape[0])
    y = y.reshape(*x.shape[:-1], weight.shape[0])
    return y + bias if bias is not None else y.clone()  # a tensor of its own, not a view


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


class _Mode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return linear(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def mode() -> Iterator[None]:
    """Within (on this thread): ``F.linear`` is :func:`linear`, one intra-op thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(NUM_THREADS)
    try:
        with _Mode():
            yield
    finally:
        torch.set_num_threads(threads)


def refuse_cuda(device: torch.device | str) -> None:
    """The mode's one line on a GPU: its batch-invariant kernels are not built."""
    if torch.device(device).type != "cpu":
        raise ValueError(
            f"--true-on-policy runs on CPU only (device {device}): the GPU's batch-invariant "
            "kernels are not built yet"
        )


def _mask(*args, **kwargs):
    from transformers.masking_utils import sdpa_mask

    # always the boolean 4-D mask, never None for "plain causal": attention() reads it
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register_hf() -> str:
    """Register :func:`attention` (and a mask function that always builds the boolean mask)
    with transformers under :data:`HF_ATTENTION_NAME`; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(HF_ATTENTION_NAME, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(HF_ATTENTION_NAME, _mask)
    return HF_ATTENTION_NAME
