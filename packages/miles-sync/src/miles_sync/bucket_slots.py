"""Reusable bucket buffers: bucket ``i`` is packed into slot ``i % 2`` (double buffering).

While bucket ``i`` is on its way (an HTTP call plus a broadcast, or an IPC load), bucket ``i + 1``
is packed into the other slot; a slot is reused only after its previous bucket was delivered
(the caller waits for that). Packing does not block the host: the copies are stream-ordered and
a consumer on another thread calls :meth:`BucketSlots.wait_ready`. The byte layout is the
codec's: the tensors in :func:`miles_sync.buckets.aligned_order`, laid out densely
(:func:`miles_sync.buckets.bucket_layout`), so a receiver that rebuilds the layout from names,
dtypes and shapes, as SGLang's ``FlattenedTensorBucket.empty`` does, finds every tensor where the
sender put it.
"""

from __future__ import annotations

import torch

from miles_sync.buckets import (
    FlattenedTensorMetadata,
    aligned_order,
    bucket_layout,
    write_entry,
)


class BucketSlots:
    """``count`` uint8 buffers on ``device``, each grown on demand to the largest bucket packed
    into it (at most ``capacity``, except that a tensor larger than the bucket size travels alone
    in a slot of its own size). A slot is never larger than its buckets: a shared buffer crosses
    to the engine whole, and an engine may refuse storages larger than its model (the built-in
    engine does), so a small model's bucket does not ship a ``capacity``-sized buffer.

    ``shared``: CPU buffers live in shared memory (torch's ``file_system`` strategy), so that a
    pickled bucket crosses to another process as a file name rather than as bytes.
    """

    def __init__(self, device: torch.device | str, capacity: int, shared: bool = False, count=2):
        self.device = torch.device(device)
        self.capacity = int(capacity)
        self.shared = shared
        self._slots: list[torch.Tensor | None] = [None] * count
        self._ready: list[torch.cuda.Event | None] = [None] * count

    @property
    def held_bytes(self) -> int:
        """Bytes the slots' buffers hold now (each the largest bucket packed into it)."""
        return sum(buf.numel() for buf in self._slots if buf is not None)

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        buf = self._slots[slot]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            if self.shared and self.device.type == "cpu":
                buf.share_memory_()
            self._slots[slot] = buf
        return buf

    @torch.no_grad()
    def pack(
        self, index: int, named: list[tuple[str, torch.Tensor]]
    ) -> tuple[torch.Tensor, list[FlattenedTensorMetadata]]:
        """Copy ``named`` into slot ``index % count`` (a deferred tensor fills its range of the
        slot itself, :mod:`miles_sync.deferred`); return the bucket (a view) and metadata (in
        :func:`~miles_sync.buckets.aligned_order`, the order the receiver must be told)."""
        named = aligned_order(named)
        metadata, total = bucket_layout((name, t.shape, t.dtype) for name, t in named)
        flat = self._buffer(index % len(self._slots), total)[:total]
        for meta, (_, tensor) in zip(metadata, named):
            write_entry(flat, meta, tensor, non_blocking=True)
        if self.device.type == "cuda":  # no host wait: consumers wait for this event
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._ready[index % len(self._slots)] = event
        return flat, metadata

    def synchronize(self, index: int) -> None:
        """Block the host until bucket ``index`` is packed. A CUDA IPC receiver waits for the
        handle's event only when it opens the handle; one that still holds the mapping from an
        earlier bucket in the same buffer (torch keeps an opened handle while any tensor on it
        lives) does not, so an IPC sender makes the bytes final before it hands a bucket over."""
        event = self._ready[index % len(self._slots)]
        if event is not None:
            event.synchronize()

    def wait_ready(self, index: int) -> None:
        """Make the calling thread's current stream wait until bucket ``index`` is packed (a
        CUDA IPC receiver needs nothing: torch's IPC handle carries its own event)."""
        event = self._ready[index % len(self._slots)]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
