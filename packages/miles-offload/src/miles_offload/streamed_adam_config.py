"""Configuration of the streamed AdamW (:mod:`miles_offload.streamed_adam`)."""

from __future__ import annotations

from dataclasses import dataclass

from miles_offload.optimizer_buckets import MOMENT_DTYPES


@dataclass(frozen=True)
class StreamedAdamConfig:
    """Where and how the streamed state lives.

    ``chunk_mb`` x ``ring_chunks`` is the pinned staging ring of each bucket file's streamer
    (host memory: buckets x ring). ``foreach`` / ``fused`` as in ``torch.optim.AdamW``.
    ``rank`` / ``world_size``: this optimizer's place among the ranks that share one
    checkpoint (its ``rank<R>/`` directory and the manifest's world size); None takes
    torch.distributed's. A caller whose ranks each hold a different set of parameter shards
    (megatron's distributed optimizer) gives each rank a checkpoint of its own with
    ``rank=0, world_size=1``.
    """

    disk_dir: str | None = None
    moment_dtype: str = "fp32"
    bucket_numel: int = 200_000_000
    min_numel: int = 65536
    chunk_mb: int = 16
    ring_chunks: int = 4
    io_threads: int = 4
    direct_io: bool = True
    name: str = "actor"
    rank: int | None = None
    world_size: int | None = None
    foreach: bool | None = None
    fused: bool | None = None

    def __post_init__(self) -> None:
        if self.moment_dtype not in MOMENT_DTYPES:
            raise ValueError(
                f"--stream-optimizer-state-moment-dtype must be one of {sorted(MOMENT_DTYPES)}, "
                f"got {self.moment_dtype!r}"
            )
        if self.bucket_numel < 1:
            raise ValueError(
                f"--stream-optimizer-bucket-numel must be >= 1, got {self.bucket_numel}"
            )
        if self.min_numel < 0:
            raise ValueError(f"--stream-optimizer-min-numel must be >= 0, got {self.min_numel}")
