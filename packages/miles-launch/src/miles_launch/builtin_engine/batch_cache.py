"""The running batch's KV cache: rows left-padded to one length, ``mask[b, j] = 1`` where row
``b`` holds a real token (the layout :mod:`miles_launch.builtin_engine.scheduler` describes).
Rows join (:func:`merge`), leave (:func:`select`), and columns that are padding in every row
are dropped (:func:`trim`); each returns a new ``(cache, mask)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [B, H, S, D]


def layers(cache: DynamicCache) -> KV:
    """The cache's per-layer ``(keys, values)``."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def pad_left(t: torch.Tensor, length: int) -> torch.Tensor:
    """Pad dim -2 (sequence) of a ``[B, H, S, D]`` cache tensor on the left to ``length``."""
    return F.pad(t, (0, 0, length - t.shape[-2], 0))


def merge(
    cache: DynamicCache | None, mask: torch.Tensor | None, kv: KV, new_mask: torch.Tensor
) -> tuple[DynamicCache, torch.Tensor]:
    """The batch with prefilled rows ``kv``/``new_mask`` appended, whichever side is shorter
    left-padded."""
    if cache is None:
        return DynamicCache(ddp_cache_data=kv), new_mask
    width = max(mask.shape[1], new_mask.shape[1])
    merged = [
        (
            torch.cat([pad_left(ok, width), pad_left(nk, width)]),
            torch.cat([pad_left(ov, width), pad_left(nv, width)]),
        )
        for (ok, ov), (nk, nv) in zip(layers(cache), kv)
    ]
    mask = torch.cat(
        [F.pad(mask, (width - mask.shape[1], 0)), F.pad(new_mask, (width - new_mask.shape[1], 0))]
    )
    return DynamicCache(ddp_cache_data=merged), mask


def trim(cache: DynamicCache, mask: torch.Tensor) -> tuple[DynamicCache, torch.Tensor]:
    """Drop the leading columns that are padding in every row."""
    first = int((mask.sum(0) > 0).nonzero()[0])
    if not first:
        return cache, mask
    kv = [(k[:, :, first:], v[:, :, first:]) for k, v in layers(cache)]
    return DynamicCache(ddp_cache_data=kv), mask[:, first:]


def select(
    cache: DynamicCache, mask: torch.Tensor, keep: list[int]
) -> tuple[DynamicCache | None, torch.Tensor | None]:
    """Only rows ``keep`` (``(None, None)`` when none is kept), trimmed."""
    if not keep:
        return None, None
    index = torch.tensor(keep, device=mask.device)
    kv = [(k.index_select(0, index), v.index_select(0, index)) for k, v in layers(cache)]
    return trim(DynamicCache(ddp_cache_data=kv), mask.index_select(0, index))


def row(kv: KV, b: int) -> DynamicCache:
    """Row ``b`` of ``kv`` alone, as a cache of batch 1."""
    index = torch.tensor([b], device=kv[0][0].device)
    return DynamicCache(
        ddp_cache_data=[(k.index_select(0, index), v.index_select(0, index)) for k, v in kv]
    )


def stack(rows: list[KV]) -> DynamicCache:
    """One cache of the rows' caches (each of batch 1), in order."""
    return DynamicCache(
        ddp_cache_data=[
            (torch.cat([r[i][0] for r in rows]), torch.cat([r[i][1] for r in rows]))
            for i in range(len(rows[0]))
        ]
    )
