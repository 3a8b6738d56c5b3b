"""The ``cpu`` target: one group's tensors in a pinned arena, at fixed offsets.

The arena is allocated at the first sleep (the only time pinning is paid) and reused by
every later sleep while the group's layout (keys, sizes) stays the same; a changed layout
(for example optimizer state created after the first sleep) allocates a new one.
"""

from __future__ import annotations

import torch
from miles_native import CopyEngine, PinnedArena

from miles_offload import allocation
from miles_offload.state_tensors import MovedTensor

ALIGNMENT = 512  # bytes between slots; DMA-friendly and a multiple of every dtype size
# torch's CUDA caching allocator: requests above 1 MiB come from its large pool, rounded to 512 B.
LARGE_POOL_MIN = 1 << 20
ALLOCATOR_ROUND = 512


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def layout_of(entries: list[MovedTensor]) -> tuple[tuple[str, int, str], ...]:
    return tuple((e.key, e.nbytes, str(e.source.dtype)) for e in entries)


def plan_segments(nbytes: list[int], segment_bytes: int) -> dict[int, int]:
    """Where :meth:`PinnedStore.copy_out` reserves allocator segments: ``{index: bytes}``, a
    reservation made just before tensor ``index`` is allocated, covering it and the following
    large-pool tensors up to ``segment_bytes`` in all (a larger tensor gets one of its own).
    Tensors of 1 MiB or less come from the allocator's small pool and are not counted."""
    plan: dict[int, int] = {}
    first, total = None, 0
    for i, n in enumerate(nbytes):
        if n <= LARGE_POOL_MIN:
            continue
        size = _round_up(n, ALLOCATOR_ROUND)
        if first is not None and total + size > segment_bytes:
            plan[first] = total
            first, total = None, 0
        if first is None:
            first = i
        total += size
    if first is not None:
        plan[first] = total
    return plan


def reserve_segment(nbytes: int, device: torch.device) -> None:
    """Leave one free cached segment of ``nbytes`` in torch's caching allocator, so that the
    allocations that follow are best-fit splits of it rather than segments of their own.

    The next sleep then frees a few large segments (one ``cudaFree`` each) instead of hundreds,
    and wake makes a few ``cudaMalloc`` calls. A segment is returned to the device only when all
    of it is free: the moved tensors die together at the next sleep (training updates them in
    place). When the block does not fit, nothing changes: the tensors get segments of their own.
    """
    try:
        torch.empty(nbytes, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError:
        pass


class PinnedStore:
    """Host copies of one group in one arena; slot ``i`` belongs to ``entries[i]``."""

    def __init__(self) -> None:
        self.arena: PinnedArena | None = None
        self._flat: torch.Tensor | None = None
        self._layout: tuple = ()
        self._offsets: list[int] = []
        self.holds_current = False  # the arena holds the group's present values

    @property
    def nbytes(self) -> int:
        return 0 if self.arena is None else self.arena.nbytes

    def prepare(self, entries: list[MovedTensor]) -> bool:
        """Fit the arena to ``entries``; returns True when a new arena was allocated."""
        layout = layout_of(entries)
        if layout == self._layout and self.arena is not None:
            return False
        offsets, end = [], 0
        for e in entries:
            offsets.append(end)
            end = _round_up(end + e.nbytes, ALIGNMENT)
        arena = allocation.pinned_arena("pinned host copy", max(end, 1))
        self._flat = None
        self.arena = arena
        self._flat = torch.frombuffer(self.arena, dtype=torch.uint8)
        self._layout, self._offsets = layout, offsets
        self.holds_current = False
        return True

    def owns(self, t: torch.Tensor) -> bool:
        """True when ``t``'s bytes lie inside this store's arena."""
        if self.arena is None:
            return False
        return self.arena.ptr <= t.data_ptr() < self.arena.ptr + self.arena.nbytes

    def view(self, i: int, e: MovedTensor) -> torch.Tensor:
        """Slot ``i`` as a tensor shaped like ``e.source`` (contiguous)."""
        off = self._offsets[i]
        raw = self._flat[off : off + e.nbytes]
        return raw.view(e.source.dtype).view(e.source.shape)

    def copy_in(
        self, entries: list[MovedTensor], engine: CopyEngine, after_stream: int
    ) -> list[torch.Tensor]:
        """Enqueue device -> arena copies; returns the slot views (valid once synchronized)."""
        views = [self.view(i, e) for i, e in enumerate(entries)]
        dst, src, size = [], [], []
        for v, e in zip(views, entries):
            if e.nbytes == 0:
                continue
            if e.source.is_contiguous():
                dst.append(v.data_ptr())
                src.append(e.source.data_ptr())
                size.append(e.nbytes)
            else:
                v.copy_(e.source, non_blocking=True)
        engine.submit(dst, src, size, to_device=False, after_stream=after_stream)
        return views

    def copy_out(
        self,
        entries: list[MovedTensor],
        device: torch.device,
        engine: CopyEngine,
        after_stream: int,
        submit_bytes: int = 256 << 20,
        segment_bytes: int = 2 << 30,
    ) -> list[torch.Tensor]:
        """Allocate device tensors and enqueue arena -> device copies (``e.source`` in the arena).

        On CUDA the tensors are carved from allocator segments of up to ``segment_bytes``
        reserved as the allocation reaches them (:func:`plan_segments`); copies are enqueued
        every ``submit_bytes`` of allocated tensors, so the copy engine is busy while the next
        segment is reserved (a ``cudaMalloc``).

        An allocation the device refuses raises :class:`~miles_offload.allocation.
        AllocationFailed` once the copies already enqueued finished (the tensors allocated so
        far are then dropped: nothing writes into released memory).
        """
        reserve_at = {}
        if device.type == "cuda":
            reserve_at = plan_segments([e.nbytes for e in entries], segment_bytes)
        out: list[torch.Tensor] = []
        dst, src, size = [], [], []
        pending = 0
        for i, e in enumerate(entries):
            if i in reserve_at:
                reserve_segment(reserve_at[i], device)
            try:
                t = allocation.allocate(e.key, e.source.shape, e.source.dtype, device)
            except allocation.AllocationFailed:
                engine.synchronize()
                out.clear()  # the error's traceback keeps this frame: drop the tensors now
                t = None
                raise
            out.append(t)
            if e.nbytes:
                dst.append(t.data_ptr())
                src.append(e.source.data_ptr())
                size.append(e.nbytes)
                pending += e.nbytes
            if pending >= submit_bytes:
                engine.submit(dst, src, size, to_device=True, after_stream=after_stream)
                dst, src, size, pending = [], [], [], 0
        if dst:
            engine.submit(dst, src, size, to_device=True, after_stream=after_stream)
        return out

    def close(self) -> None:
        """Drop this store's references; the memory goes when no tensor views it any more."""
        self._flat = None
        self.arena = None
        self._layout = ()
