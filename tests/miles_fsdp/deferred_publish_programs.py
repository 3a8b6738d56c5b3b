"""Rank programs of test_deferred_publish: what an awake FSDP publish writes, and where.

:func:`written_bytes` counts, under a dispatch mode, the bytes every op writes while a weight
source is iterated and packed into bucket slots (the work of an ``ipc`` publish on one rank);
:func:`publish_program` publishes over ``ipc`` (deferred tensors) and ``broadcast`` to two real
built-in engines and records their digests beside the materialised source's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx
import torch
import torch.distributed as dist
import xxhash
from asleep_publish_programs import rollout
from miles_fsdp.backend import FSDPBackend
from miles_sync.deferred import DeferredTensor
from run_args import make_args
from spawn import gather_to_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

BUCKET = 4096  # many buckets; the largest tensor travels alone
CHUNK = 300  # asleep reads of at most 300 bytes: 1-2 fp32 rows of every 2-D shard
#: Ops that allocate, wait or wrap without writing a tensor's bytes.
NOT_WRITES = ("empty", "empty_strided", "empty_like", "new_empty", "wait_tensor", "_wrap_tensor")


class WrittenBytes(TorchDispatchMode):
    """Bytes of every plain tensor an op writes: new outputs and in-place/out= results (copies,
    casts, all-gathers); views, allocations and ops on tensor subclasses (DTensor, whose local
    ops are counted themselves) count nothing."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        returns = func._schema.returns
        if name in NOT_WRITES or any(r.alias_info and not r.alias_info.is_write for r in returns):
            return out
        for value in tree_flatten(out)[0]:
            if type(value) is torch.Tensor:
                self.bytes += value.numel() * value.element_size()
        return out


def written_bytes(pairs) -> dict[str, int]:
    """Iterate ``pairs`` and pack them as an ``ipc`` publish does (every rank, lock step):
    ``{"written": bytes every op wrote, "published": bytes of the buckets, "deferred": how many
    tensors were deferred}``."""
    from miles_sync.bucket_slots import BucketSlots
    from miles_sync.buckets import plan_buckets_marked
    from miles_sync.deferred import DeferredTensor

    slots = BucketSlots("cpu", BUCKET)
    published = deferred = 0
    with WrittenBytes() as counter:
        for index, (named, _) in enumerate(plan_buckets_marked(pairs, BUCKET)):
            deferred += sum(isinstance(t, DeferredTensor) for _, t in named)
            flat, _ = slots.pack(index, named)
            published += flat.numel()
    return {"written": counter.bytes, "published": published, "deferred": deferred}


def reference(backend: FSDPBackend) -> dict[str, list]:
    """Digests of the materialised source (every rank iterates it; rank 0's result)."""
    out = {}
    for name, tensor in backend.weight_source(BUCKET):
        raw = tensor.contiguous().view(-1).view(torch.uint8).numpy()
        out[name] = [xxhash.xxh3_128_hexdigest(raw), str(tensor.dtype), list(tensor.shape)]
    return out


def publish(backend: FSDPBackend, mode: str, urls: list[str]) -> dict:
    from miles_sync.ranks import RankContext
    from miles_sync.weight_sync import SyncConfig, WeightPublisher

    config = SyncConfig(
        mode=mode, buffer_size=BUCKET, colocate=mode == "ipc", verify=True, group_timeout_s=60
    )
    publisher = WeightPublisher(config, RankContext.from_default_group())
    publisher.update_weights(backend.weight_source(BUCKET), urls)
    stats = publisher.last_stats
    publisher.close()
    dist.barrier()
    engines = None
    if dist.get_rank() == 0:
        engines = [httpx.get(f"{u}/weights_digest", timeout=60).json() for u in urls]
    return {"engines": engines, "verified": stats.get("verified")}


def chunked_reads(backend: FSDPBackend, chunk: int) -> dict:
    """Asleep: the deferred source with ``read_bytes=chunk``, materialised. Each deferred
    tensor's reads (bytes of each) and the digests of every tensor."""
    source = backend.weight_source(BUCKET)
    current: list[list[int] | None] = [None]

    def read(t: torch.Tensor, rows: tuple[int, int] | None = None) -> torch.Tensor:
        out = source.read(t, rows)
        if current[0] is not None:
            current[0].append(out.numel() * out.element_size())
        return out

    reads, digests = {}, {}
    for name, tensor in dataclasses.replace(source, read=read, read_bytes=chunk).deferred():
        if isinstance(tensor, DeferredTensor):
            current[0] = reads[name] = []
            tensor = tensor.materialize()
            current[0] = None
        raw = tensor.contiguous().view(-1).view(torch.uint8).numpy()
        digests[name] = [xxhash.xxh3_128_hexdigest(raw), str(tensor.dtype), list(tensor.shape)]
    return {"reads": reads, "digests": digests, "chunk": chunk}


def wait_healthy(urls: list[str], timeout: float = 240.0) -> None:
    """Every rank: return once every engine answers ``/health``."""
    import time

    deadline = time.monotonic() + timeout
    for url in urls:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {url} not healthy")
            time.sleep(0.2)


def publish_program(rank, world, even_dir, hf_dir, urls, out_file):
    """On ``even_dir`` (every tensor shards evenly): train, count the bytes written by the
    materialised and the deferred source. On ``hf_dir`` (the engines' model), a step before
    each: publish over ipc (every rank leads its own engine), asleep over ipc (the reference
    is the awake source's), and over broadcast."""
    flags = dict(lr=1e-2, advantage_estimator="grpo")
    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=even_dir, **flags))
    try:
        backend.train(0, rollout(0))
        res = {
            "materialized": written_bytes(iter(backend.weight_source(BUCKET))),
            "deferred": written_bytes(backend.weight_source(BUCKET).deferred()),
        }
    finally:
        backend.close()
    backend = FSDPBackend()
    backend.init(
        make_args(
            hf_checkpoint=hf_dir,
            offload_train=True,
            offload_train_target="disk",
            offload_train_disk_dir=str(Path(out_file).parent / "offload"),
            **flags,
        )
    )
    try:
        backend.train(0, rollout(0))
        res["master_dtypes"] = sorted({str(p.dtype) for p in backend.model.parameters()})
        res["published"] = written_bytes(backend.weight_source(BUCKET).deferred())
        wait_healthy(urls)
        res["ipc"] = publish(backend, "ipc", urls) | {"reference": reference(backend)}
        backend.train(1, rollout(1))
        awake = reference(backend)
        backend.sleep()  # asleep, the deferred fills read each shard from its file
        res["asleep_chunked"] = chunked_reads(backend, CHUNK)
        res["asleep_ipc"] = publish(backend, "ipc", urls) | {"reference": awake}
        res["still_asleep"] = backend.asleep
        backend.wake_up()
        backend.train(2, rollout(2))
        res["broadcast"] = publish(backend, "broadcast", urls) | {"reference": reference(backend)}
        gather_to_file(res, out_file)
    finally:
        backend.close()
