"""The ``disk`` target: one group's device storages streamed to a per-rank file.

Sleep writes every distinct storage behind the group's tensors through the
:class:`~miles_native.FileStreamer`'s pinned ring (device -> ring -> file, host memory =
the ring) and then frees the device memory by resizing each storage to zero bytes. The
tensors themselves (Parameters, DTensor shards, optimizer state) are untouched, so every
object and view survives; wake re-grows each storage and streams its bytes back. The file
is opened once, overwritten in place at every sleep and removed on close or at exit.

While the group sleeps, :meth:`DiskStore.read` gives one tensor's values without waking it:
the 4 KiB-aligned window of the file that holds the tensor's bytes is read into a reusable
page-aligned staging buffer and copied to the device (what a publish from a sleeping trainer
streams, one tensor at a time).
"""

from __future__ import annotations

import logging
import os
import weakref

import torch
from miles_native import CopyEngine, PinnedArena, open_file_streamer

from miles_offload import allocation
from miles_offload.offload_target import OffloadTarget
from miles_offload.state_tensors import MovedTensor, byte_window, from_window

logger = logging.getLogger(__name__)

ALIGNMENT = 512
DIRECT_ALIGNMENT = 4096  # O_DIRECT reads: address, offset and size
RAM_FILESYSTEMS = {"tmpfs", "ramfs"}


def filesystem_type(path: str) -> str:
    """The type of the filesystem holding ``path`` (longest mount point prefix in /proc/mounts)."""
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) > len(best):
                    best, kind = mount, fields[2]
    except OSError:
        pass
    return kind


def _close_streamer(streamer) -> None:
    if streamer.is_open:
        streamer.close(remove=True)


class DiskStore:
    """One group's bytes in ``<dir>/miles-offload-<pid>-rank<rank>-<group>.bin``."""

    def __init__(self, target: OffloadTarget, rank: int, group: str) -> None:
        directory = target.resolved_disk_dir
        os.makedirs(directory, exist_ok=True)
        fs = filesystem_type(directory)
        if fs in RAM_FILESYSTEMS:
            logger.warning(
                "--offload-train-disk-dir %s is on %s: the 'disk' copy lives in host RAM",
                directory,
                fs,
            )
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in group)
        self.path = os.path.join(directory, f"miles-offload-{os.getpid()}-rank{rank}-{safe}.bin")
        self.streamer = open_file_streamer(
            self.path,
            target.chunk_bytes,
            ring_chunks=target.ring_chunks,
            io_threads=target.io_threads,
            direct=target.direct_io,
        )
        self._finalizer = weakref.finalize(self, _close_streamer, self.streamer)
        self._storages: list[torch.UntypedStorage] = []
        self._sizes: list[int] = []
        self._keys: list[str] = []
        self._offsets: list[int] = []
        self._layout: tuple = ()
        self._index: dict[int, int] = {}  # storage identity -> its slot in the file
        self._staging: PinnedArena | None = None
        self.holds_current = False  # the file holds the group's present values

    @property
    def ring_bytes(self) -> int:
        return self.streamer.ring_bytes

    def _plan(self, entries: list[MovedTensor]) -> None:
        storages, keys, seen = [], [], set()
        for e in entries:
            st = e.source.untyped_storage()
            if st.nbytes() == 0 or st.data_ptr() in seen:
                continue
            seen.add(st.data_ptr())
            storages.append(st)
            keys.append(e.key)
        sizes = [st.nbytes() for st in storages]
        layout = tuple(e.key for e in entries) + tuple(sizes)
        if layout != self._layout:
            self.holds_current = False
        offsets, end = [], 0
        for n in sizes:
            offsets.append(end)
            end = (end + n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
        self._storages, self._sizes, self._offsets, self._layout = storages, sizes, offsets, layout
        self._keys = keys  # for messages
        self._index = {st._cdata: i for i, st in enumerate(storages)}

    def holds(self, t: torch.Tensor) -> bool:
        """True when ``t``'s storage is one this store wrote."""
        return t.untyped_storage()._cdata in self._index

    def read(
        self, t: torch.Tensor, device: torch.device, rows: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """``t``'s values (``t`` asleep in this store, see :meth:`holds`) as a new tensor on
        ``device`` with ``t``'s shape, dtype and strides; the file is read, nothing is woken.
        ``rows=(begin, end)``: ``t[begin:end]``'s values only (a tensor whose storage is freed
        cannot be sliced itself)."""
        slot = self._index[t.untyped_storage()._cdata]
        offset, nbytes = byte_window(t)
        if rows is not None:
            begin, end = rows
            offset += begin * t.stride(0) * t.element_size()
            t = torch.empty_strided(
                (end - begin, *t.shape[1:]), t.stride(), dtype=t.dtype, device="meta"
            )
            nbytes = byte_window(t)[1]
        begin = self._offsets[slot] + offset
        lo = begin // DIRECT_ALIGNMENT * DIRECT_ALIGNMENT
        hi = (begin + nbytes + DIRECT_ALIGNMENT - 1) // DIRECT_ALIGNMENT * DIRECT_ALIGNMENT
        if self._staging is None or self._staging.nbytes < hi - lo:
            self._staging = PinnedArena(hi - lo, pin=True)
        self.streamer.read(self._staging.ptr, hi - lo, lo)
        host = torch.frombuffer(self._staging, dtype=torch.uint8)[begin - lo : begin - lo + nbytes]
        return from_window(host, t, device)

    def sleep(self, entries: list[MovedTensor], engine: CopyEngine, after_stream: int) -> int:
        """Write (unless the file already holds these values) and free; returns bytes written."""
        self._plan(entries)
        written = 0
        if not self.holds_current:
            ptrs = [st.data_ptr() for st in self._storages]
            self.streamer.store(ptrs, self._offsets, self._sizes, engine, after_stream)
            written = sum(self._sizes)
        for st in self._storages:
            st.resize_(0)
        return written

    def wake(self, engine: CopyEngine, after_stream: int) -> int:
        """Re-grow every storage on its device and read its bytes back; returns bytes read.
        A storage the device refuses to grow raises :class:`~miles_offload.allocation.
        AllocationFailed` with every storage freed again (the file still holds them all)."""
        try:
            for st, n, key in zip(self._storages, self._sizes, self._keys):
                allocation.grow(key, st, n)
        except allocation.AllocationFailed:
            self.release()
            raise
        ptrs = [st.data_ptr() for st in self._storages]
        self.streamer.load(ptrs, self._offsets, self._sizes, engine, after_stream)
        return sum(self._sizes)

    def release(self) -> None:
        """Free every storage again after a wake (their values are still in the file)."""
        for st in self._storages:
            st.resize_(0)

    def close(self) -> None:
        self._staging = None
        self._finalizer()
