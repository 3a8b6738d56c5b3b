"""Where a sleeping trainer's state goes: pinned host memory (``cpu``) or files (``disk``)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Literal

from miles_core.args.parsed import ParsedArgs


def default_disk_dir() -> str:
    """``<temp dir>/miles_offload``: used when ``--offload-train-disk-dir`` is unset."""
    return os.path.join(tempfile.gettempdir(), "miles_offload")


@dataclass(frozen=True)
class OffloadTarget:
    """``kind="cpu"``: one pinned arena per model/optimizer, sized at the first sleep and reused.

    ``kind="disk"``: per-rank files under ``disk_dir``, streamed through ``ring_chunks`` pinned
    staging chunks of ``chunk_mb`` MiB (host memory = ``ring_chunks * chunk_mb`` MiB per file
    while streaming). A frozen model's copy (arena or file) is written at its first sleep
    only; later sleeps just release the device memory.
    """

    kind: Literal["cpu", "disk"] = "cpu"
    disk_dir: str | None = None
    chunk_mb: int = 256
    ring_chunks: int = 4
    io_threads: int = 4
    direct_io: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("cpu", "disk"):
            raise ValueError(f"OffloadTarget.kind must be 'cpu' or 'disk', not {self.kind!r}")
        if self.chunk_mb < 1 or self.ring_chunks < 1 or self.io_threads < 1:
            raise ValueError("OffloadTarget: chunk_mb, ring_chunks and io_threads must be >= 1")

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_mb << 20

    @property
    def resolved_disk_dir(self) -> str:
        return self.disk_dir if self.disk_dir is not None else default_disk_dir()

    @classmethod
    def from_args(cls, args: ParsedArgs) -> OffloadTarget:
        """From ``--offload-train-target``, ``--offload-train-disk-dir``, ``--offload-train-disk-chunk-mb``."""
        return cls(
            kind=args.offload_train_target,
            disk_dir=args.offload_train_disk_dir,
            chunk_mb=args.offload_train_disk_chunk_mb,
        )
