"""Bucket layout of the streamed AdamW state: which elements of which parameter live where.

Each streamed parameter contributes its local shard (``p.to_local()`` for a DTensor),
flattened. Shards are packed in parameter order into buckets of at most ``bucket_numel``
elements; a shard that does not fit is split across consecutive buckets (AdamW is
elementwise, so any split gives the same result). Every piece is a :class:`Segment`.

One bucket is one file (and one device buffer with the identical byte layout). For each
segment, in order, the file holds three entries, each starting on a 4 KiB boundary::

    master     (fp32,         numel * 4 bytes)
    exp_avg    (moment dtype, numel * itemsize)
    exp_avg_sq (moment dtype, numel * itemsize)

and the file size is rounded up to 4 KiB, so O_DIRECT can move a whole bucket in one request.

A shard's place in the full parameter is a flat element range ``[global_start, global_start +
numel)`` of the row-major parameter: true for plain tensors (the whole range) and for DTensors
sharded on dim 0 only (FSDP2's ``Shard(0)``, possibly with ``Replicate`` dims). Checkpoints
use these ranges to re-bucket the state for a different DP size or bucket size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

ALIGNMENT = 4096
KINDS = ("master", "exp_avg", "exp_avg_sq")
MOMENT_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class Shard:
    """This rank's part of one streamed parameter."""

    index: int  # position in the optimizer's list of streamed parameters
    name: str
    shape: tuple[int, ...]  # the full parameter's shape
    global_start: int  # flat element offset of the local shard in the full parameter
    numel: int  # elements of the local shard


@dataclass(frozen=True)
class Segment:
    """``numel`` elements of shard ``index`` from local element ``start`` on."""

    index: int
    name: str
    start: int
    numel: int
    global_start: int  # flat offset of element ``start`` in the full parameter
    offsets: tuple[int, int, int]  # byte offsets of master, exp_avg, exp_avg_sq in the bucket

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "start": self.start,
            "numel": self.numel,
            "global_start": self.global_start,
            "offsets": list(self.offsets),
        }


@dataclass(frozen=True)
class Bucket:
    index: int
    segments: tuple[Segment, ...]
    nbytes: int  # file size (multiple of 4 KiB)

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.segments)

    @property
    def file_name(self) -> str:
        return f"bucket_{self.index:05d}.bin"


def local_shard(p: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(local tensor, flat offset of it in the full parameter)``; see the module docstring."""
    if not isinstance(p, DTensor):
        return p.detach(), 0
    local = p.to_local().detach()
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if tuple(shape[1:]) != tuple(p.shape[1:]) or tuple(local.shape) != tuple(shape):
        raise ValueError(
            f"streamed AdamW supports DTensors sharded on dim 0 only (FSDP2); got placements "
            f"{p.placements} for a parameter of shape {tuple(p.shape)}"
        )
    if not local.is_contiguous():
        raise ValueError("streamed AdamW needs contiguous local shards")
    row = math.prod(p.shape[1:]) if p.dim() > 0 else 1
    return local, (offset[0] * row if p.dim() > 0 else 0)


def plan_buckets(shards: list[Shard], bucket_numel: int, moment_itemsize: int) -> list[Bucket]:
    """Pack ``shards`` (in order) into buckets of at most ``bucket_numel`` elements."""
    if bucket_numel < 1:
        raise ValueError(f"--stream-optimizer-bucket-numel must be >= 1, got {bucket_numel}")
    itemsizes = (4, moment_itemsize, moment_itemsize)
    buckets: list[Bucket] = []
    pieces: list[tuple[Shard, int, int]] = []
    fill = 0

    def close() -> None:
        nonlocal pieces, fill
        segments, cursor = [], 0
        for shard, start, numel in pieces:
            offsets = []
            for size in itemsizes:
                cursor = align_up(cursor)
                offsets.append(cursor)
                cursor += numel * size
            segments.append(
                Segment(
                    shard.index,
                    shard.name,
                    start,
                    numel,
                    shard.global_start + start,
                    (offsets[0], offsets[1], offsets[2]),
                )
            )
        buckets.append(Bucket(len(buckets), tuple(segments), align_up(cursor)))
        pieces, fill = [], 0

    for shard in shards:
        start = 0
        while start < shard.numel:
            take = min(shard.numel - start, bucket_numel - fill)
            pieces.append((shard, start, take))
            start += take
            fill += take
            if fill == bucket_numel:
                close()
    if pieces:
        close()
    return buckets


def entry_view(
    buffer: torch.Tensor, segment: Segment, kind: int, moment_dtype: torch.dtype
) -> torch.Tensor:
    """The 1-D view of entry ``kind`` (0 master, 1 exp_avg, 2 exp_avg_sq) in a bucket buffer."""
    dtype = torch.float32 if kind == 0 else moment_dtype
    size = torch.empty((), dtype=dtype).element_size()
    begin = segment.offsets[kind]
    return buffer[begin : begin + segment.numel * size].view(dtype)
