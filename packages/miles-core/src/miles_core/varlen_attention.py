"""Causal attention over THD-packed rows without a mask: torch's own varlen flash attention.

A packed micro-batch is one row of several samples; attention must stay inside each sample.
The ``sdpa`` path of :func:`miles_core.packing.packed_attention_kwargs` does that with a
``T x T`` block-diagonal mask, which both costs ``T^2`` bytes and keeps SDPA off its flash
kernel: at 16k tokens per row most of the attention work is on masked-out blocks. Here the
samples' boundaries (``cu_seqlens``) go to ``torch.nn.attention.varlen.varlen_attn`` (the flash
kernel torch ships for CUDA), so attention costs ``sum(s_i^2)`` and no mask exists.

Without CUDA (or a torch without ``varlen_attn``) the same function runs one causal SDPA per
sample: slower, the same arithmetic, and what the CPU tests compare against the masked path.
miles-fsdp plugs it into transformers (``--attn-implementation varlen``,
:mod:`miles_fsdp.varlen_hf`).
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

#: the attention name a transformers model is built with for this path (registered by miles-fsdp)
HF_ATTENTION_NAME = "miles_varlen"


@functools.cache
def _torch_varlen():
    try:
        # optional: only recent torch releases ship the varlen kernel
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def kernel_available(device: torch.device | str = "cuda") -> bool:
    """Whether the flash varlen kernel serves ``device`` (CUDA and a torch that ships it)."""
    return torch.device(device).type == "cuda" and _torch_varlen() is not None


@functools.cache
def _kernel_params() -> frozenset[str]:
    """The keyword arguments this torch's ``varlen_attn`` takes (read once: it is called in
    every layer of every forward)."""
    return frozenset(inspect.signature(_torch_varlen()).parameters)


def _flash(q, k, v, cu_seqlens, max_seqlen, scale):
    params = _kernel_params()
    kwargs = {"scale": scale}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # causal
    else:
        kwargs["is_causal"] = True
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    return _torch_varlen()(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)


def _per_sample(q, k, v, cu_seqlens, scale):
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end == start:
            continue
        # (s, H, D) -> (H, s, D)
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
        out[start:end] = F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=ks.shape[0] != qs.shape[0]
        ).transpose(0, 1)
    return out


def varlen_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of each sample with itself. ``q``: (T, H, D); ``k``/``v``: (T, Hkv, D),
    ``H`` a multiple of ``Hkv``; ``cu_seqlens``: (N + 1,) int32 sample starts; returns (T, H, D).
    Flash varlen kernel on CUDA when torch has it, else one SDPA per sample."""
    cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
    if kernel_available(q.device) and q.dtype in (torch.float16, torch.bfloat16):
        return _flash(q, k, v, cu_seqlens, int(max_seqlen), scale)
    return _per_sample(q, k, v, cu_seqlens, scale)
