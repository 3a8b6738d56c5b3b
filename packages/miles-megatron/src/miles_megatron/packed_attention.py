"""How the Megatron backend's packed rows attend (``--attn-implementation``): ``varlen`` or
``sdpa``.

``sdpa`` (the masked path): every layer gets the packed row's boolean block-diagonal causal mask
(``T x T``; megatron masks where it is True) and :class:`~miles_megatron.sdpa_attention.
SDPAttention` runs SDPA with it, which spends most of its work on masked-out blocks at long rows.

``varlen``: every layer gets the row's sample boundaries instead of a mask, and
:class:`~miles_megatron.sdpa_attention.SDPAttention` attends each sample with itself through
:func:`miles_core.varlen_attention.varlen_causal_attention` (torch's varlen flash kernel on a
GPU in bf16/fp16; one causal SDPA per sample elsewhere), at ``sum(s_i^2)`` cost and no mask.
The boundaries travel in megatron's ``attention_mask`` argument (:func:`varlen_mask`): megatron
hands that argument untouched from ``GPTModel`` to the core attention, and saves it for
activation recomputation like any tensor, so recomputed layers see the same boundaries.

Unset, the flag means ``varlen`` on a GPU whose torch ships the varlen kernel (FSDP's rule;
flash_attn plays no part here, the Megatron backend never calls it), else ``sdpa``; ``sdpa``
also wherever varlen cannot serve: at ``--context-parallel-size > 1`` (its attention is the
masked path over all-gathered keys, :mod:`miles_megatron.context_parallel`), with attention
dropout, or a ``--spec`` whose core attention is not ``SDPAttention``. Asked for explicitly in
those cases, ``varlen`` is an error naming the flags (CP at argument time, the others when the
model is built). The choice is stored on the model's ``TransformerConfig``
(:data:`CONFIG_ATTR`), where :func:`~miles_megatron.schedule.stage_forward` reads it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from miles_core import varlen_attention
from miles_core.args import ArgumentError
from miles_core.args.parsed import ParsedArgs

logger = logging.getLogger(__name__)

#: the ``TransformerConfig`` attribute holding the resolved choice
CONFIG_ATTR = "miles_attn_implementation"


def _varlen_blocker(config: Any, model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot attend through varlen, or None."""
    # cycle: miles_megatron.sdpa_attention imports this module
    from miles_megatron.sdpa_attention import SDPAttention

    if config.context_parallel_size > 1:
        return f"--context-parallel-size {config.context_parallel_size} attends masked"
    if config.attention_dropout:
        return f"attention dropout {config.attention_dropout} (varlen has none)"
    others = {
        type(m.core_attention).__name__
        for m in model.modules()
        if isinstance(getattr(m, "core_attention", None), torch.nn.Module)
        and not isinstance(m.core_attention, SDPAttention)
    }
    if others:
        return f"the layer spec's core attention {sorted(others)} is not SDPAttention (--spec)"
    return None


def resolve_attn_implementation(args: ParsedArgs, config: Any, model: torch.nn.Module) -> str:
    """The attention ``model`` (built from ``config``) uses: ``--attn-implementation`` or its
    default; stored on ``config`` (:data:`CONFIG_ATTR`) and returned."""
    requested = args.attn_implementation
    blocker = _varlen_blocker(config, model)
    if requested == "varlen" and blocker is not None:
        raise ArgumentError(f"--attn-implementation varlen: {blocker}")
    if requested is not None:
        chosen = requested
    elif (
        blocker is None and torch.cuda.is_available() and varlen_attention.kernel_available("cuda")
    ):
        chosen = "varlen"
        _say("miles-megatron: attending packed rows with torch's varlen flash attention")
    else:
        chosen = "sdpa"
        why = blocker or "no varlen flash kernel on this device"
        _say(f"miles-megatron: attending packed rows with SDPA and a block mask ({why})")
    setattr(config, CONFIG_ATTR, chosen)
    return chosen


def attn_implementation_of(model: torch.nn.Module) -> str:
    """The resolved choice of ``model`` (through DDP / Float16Module wrappers); ``sdpa`` for a
    model built without :func:`resolve_attn_implementation`."""
    chain = [model]
    while isinstance(getattr(chain[-1], "module", None), torch.nn.Module):
        chain.append(chain[-1].module)
    for m in reversed(chain):
        value = getattr(getattr(m, "config", None), CONFIG_ATTR, None)
        if value is not None:
            return value
    return "sdpa"


def varlen_mask(cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """The ``attention_mask`` that carries a packed row's boundaries through megatron's layers:
    ``cu_seqlens`` (``[N + 1]``) as int32, expanded (a view, no copy) to ``[N + 1, max_seqlen]``
    so that the longest sample's length rides in the shape (no device sync per layer)."""
    return cu_seqlens.to(torch.int32)[:, None].expand(-1, int(max_seqlen))


def read_varlen_mask(mask: torch.Tensor | None) -> tuple[torch.Tensor, int] | None:
    """``(cu_seqlens, max_seqlen)`` of a :func:`varlen_mask`; None for any other mask."""
    if mask is None or mask.dtype != torch.int32 or mask.dim() != 2:
        return None
    return mask[:, 0].contiguous(), int(mask.shape[1])


def block_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """megatron's ``[1, 1, T, T]`` mask of the same row (True where a query may NOT attend)."""
    segment = torch.repeat_interleave(
        torch.arange(len(cu_seqlens) - 1, device=cu_seqlens.device),
        cu_seqlens.diff().long(),
        output_size=total,
    )
    positions = torch.arange(total, device=cu_seqlens.device)
    allowed = (segment[:, None] == segment[None, :]) & (positions[None, :] <= positions[:, None])
    return (~allowed)[None, None]


def _say(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info(message)
