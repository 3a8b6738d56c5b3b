"""``--update-weight-transfer-mode ipc`` (``--colocate``): buckets cross as shared-memory handles.

Each engine's TP workers sit on the GPUs of trainer ranks ``e * g ... e * g + g - 1``
(``g = gpus_per_engine``); rank ``e * g`` is that engine's leader. For every bucket, each rank
packs it into its own buffer and pickles it with torch's multiprocessing reductions
(``ForkingPickler``): a CUDA tensor travels as a CUDA IPC handle, a CPU tensor (CI) as the name
of a shared-memory file (torch's ``file_system`` sharing strategy, set by this module on CPU).
The leader gathers the ``g`` strings and posts one ``/update_weights_from_tensor`` with
``load_format: "flattened_bucket"``: one entry per engine TP rank, metadata under SGLang's class
path. No weight bytes go over HTTP. Every rank packs every bucket in lock step, so a source's
deferred tensors (:mod:`miles_sync.deferred`, e.g. FSDP shards all-gathered) are filled straight
into the rank's slot.

Double buffering: bucket ``i`` is packed into slot ``i % 2`` while bucket ``i - 1`` loads. The
leader waits for the load of bucket ``i - 1`` before the gather of bucket ``i``, and every rank
passes that gather before packing bucket ``i + 1`` into the slot of bucket ``i - 1``: a slot is
never overwritten while an engine may still read it.
"""

from __future__ import annotations

import base64
import concurrent.futures
import time
from collections.abc import Iterable, Sequence

import torch
import torch.multiprocessing
from miles_core.engine import EngineClient

from miles_sync.bucket_slots import BucketSlots
from miles_sync.buckets import dumps_sglang_wire, plan_buckets_marked, to_sglang_metadata
from miles_sync.ranks import RankContext


def serialize_bucket(flat: torch.Tensor, metadata: list) -> str:
    """One ``serialized_named_tensors`` entry: base64 of the ForkingPickler dump of
    ``{"flattened_tensor": flat, "metadata": [FlattenedTensorMetadata, ...]}``."""
    payload = {"flattened_tensor": flat, "metadata": to_sglang_metadata(metadata)}
    return base64.b64encode(dumps_sglang_wire(payload)).decode()


class IpcTransport:
    """Colocated publish: every rank shares its bucket; each engine's leader posts it."""

    def __init__(
        self,
        ctx: RankContext,
        buffer_size: int,
        gpus_per_engine: int = 1,
        device: torch.device | None = None,
    ):
        self.ctx = ctx
        self.buffer_size = buffer_size
        self.gpus_per_engine = gpus_per_engine
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
        self.device = device
        if device.type == "cpu":
            torch.multiprocessing.set_sharing_strategy("file_system")
        self.engine: EngineClient | None = None
        self.engine_index = ctx.rank // gpus_per_engine
        self._slots = BucketSlots(device, buffer_size, shared=True)

    @property
    def is_leader(self) -> bool:
        return self.ctx.rank % self.gpus_per_engine == 0

    def connect(self, engines: Sequence[EngineClient]) -> None:
        expected = len(engines) * self.gpus_per_engine
        if expected != self.ctx.world_size:
            raise ValueError(
                f"ipc (--colocate) needs one trainer rank per engine GPU: {len(engines)} engines "
                f"x {self.gpus_per_engine} GPUs = {expected}, but {self.ctx.world_size} ranks"
            )
        self.engine = engines[self.engine_index] if self.is_leader else None

    def reset(self) -> None:
        """Nothing persists between publishes but the buffers."""

    def close(self) -> None:
        self._slots = BucketSlots(self.device, self.buffer_size, shared=True)

    def push(self, source: Iterable[tuple[str, torch.Tensor]]) -> dict:
        """Every rank: pack, share, gather to the leader, load. Raises the first load error
        (on the leader) after the source was iterated to its end."""
        g = self.gpus_per_engine
        first = self.engine_index * g
        pool = concurrent.futures.ThreadPoolExecutor(1)
        pending: concurrent.futures.Future | None = None
        error: BaseException | None = None
        buckets = nbytes = 0
        waited = 0.0  # blocked on the engine's replies rather than packing
        try:
            marked = plan_buckets_marked(source, self.buffer_size)
            for index, (named, last) in enumerate(marked):
                flat, metadata = self._slots.pack(index, named)
                entry = serialize_bucket(flat, metadata)
                if pending is not None:
                    since = time.perf_counter()
                    try:
                        pending.result()
                    except BaseException as failure:
                        error = error or failure
                    waited += time.perf_counter() - since
                    pending = None
                self._slots.synchronize(index)  # the bytes are final before any engine reads
                entries = self.ctx.all_gather_object(entry)
                if self.is_leader and error is None:
                    pending = pool.submit(
                        self.engine.update_weights_from_tensor,
                        entries[first : first + g],
                        load_format="flattened_bucket",
                        flush_cache=last,  # once, after the last bucket
                    )
                buckets += 1
                nbytes += flat.numel()
            if pending is not None:
                since = time.perf_counter()
                try:
                    pending.result()
                except BaseException as failure:
                    error = error or failure
                waited += time.perf_counter() - since
        finally:
            pool.shutdown(wait=True)
        if error is not None:
            raise error
        return {"buckets": buckets, "bytes": nbytes, "delivery_wait_s": round(waited, 6)}
