"""Pushing buckets through weight-update groups: ``/update_weights_from_distributed`` per bucket
while the bucket is broadcast (shared by ``broadcast`` and ``p2p``).

A background thread delivers bucket ``i`` (one HTTP call per engine, issued concurrently, then
the broadcast, then the replies) while the calling thread iterates the weight source and packs
bucket ``i + 1`` into the other slot. The first failure stops further sends; the source is still
iterated to its end so that collective sources (FSDP all-gathers) stay in lock step.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Iterable

import torch
from miles_core.engine import EngineError

from miles_sync.bucket_slots import BucketSlots
from miles_sync.buckets import plan_buckets_marked
from miles_sync.engine_group import EngineGroup

logger = logging.getLogger(__name__)

#: How long to wait for an engine's reply after the broadcast itself failed.
REPLY_AFTER_FAILURE_S = 30.0


def deliver_bucket(
    group: EngineGroup, flat: torch.Tensor, metadata: list, flush_cache: bool = False
) -> None:
    """One bucket to every engine of ``group``: the HTTP calls, then the broadcast, then their
    replies. Raises the first engine's :class:`EngineError`. ``flush_cache``: the engines flush
    their cache after loading it (the last bucket of a publish)."""
    names = [m.name for m in metadata]
    dtypes = [m.dtype for m in metadata]
    shapes = [list(m.shape) for m in metadata]
    with concurrent.futures.ThreadPoolExecutor(len(group.engines)) as pool:
        replies = [
            pool.submit(
                engine.update_weights_from_distributed,
                names,
                dtypes,
                shapes,
                group_name=group.name,
                load_format="flattened_bucket",
                flush_cache=flush_cache,
            )
            for engine in group.engines
        ]
        try:
            group.broadcast(flat)
        except Exception as error:
            # The broadcast failed (a peer died): report the engine's own words if one answered.
            for reply in replies:
                try:
                    reply.result(timeout=REPLY_AFTER_FAILURE_S)
                except EngineError as engine_error:
                    raise engine_error from error
                except Exception:
                    pass
            raise
        for reply in replies:
            reply.result()


def _deliver(slots: BucketSlots, index: int, group, flat, metadata, last: bool) -> None:
    slots.wait_ready(index)  # this thread's stream waits for the packing copies
    deliver_bucket(group, flat, metadata, flush_cache=last)


def push_buckets(
    source: Iterable[tuple[str, torch.Tensor]],
    group: EngineGroup | None,
    *,
    buffer_size: int,
    device: torch.device,
    owns: Callable[[int], bool],
) -> dict:
    """Iterate ``source``; deliver the buckets ``owns(index)`` selects through ``group``.

    Returns ``{"buckets", "bytes", "delivery_wait_s"}``: the last is the time this thread spent
    waiting for deliveries (HTTP replies and broadcasts) rather than iterating and packing. Raises
    the first delivery error after the source was iterated to its end.
    """
    slots = BucketSlots(device, buffer_size)
    worker = concurrent.futures.ThreadPoolExecutor(1)
    in_flight: list[concurrent.futures.Future | None] = [None, None]
    error: BaseException | None = None
    sent = nbytes = 0
    waited = 0.0
    try:
        for index, (named, last) in enumerate(plan_buckets_marked(source, buffer_size)):
            if error is not None or not owns(index):
                continue
            slot = sent % 2
            previous = in_flight[slot]
            if previous is not None:
                since = time.perf_counter()
                try:
                    previous.result()
                except BaseException as failure:  # stop sending; keep iterating the source
                    error = failure
                    continue
                finally:
                    waited += time.perf_counter() - since
            flat, metadata = slots.pack(sent, named)
            in_flight[slot] = worker.submit(_deliver, slots, sent, group, flat, metadata, last)
            sent += 1
            nbytes += flat.numel()
        since = time.perf_counter()
        for future in in_flight:
            if future is not None and error is None:
                try:
                    future.result()
                except BaseException as failure:
                    error = failure
        waited += time.perf_counter() - since
    finally:
        worker.shutdown(wait=True)
    if error is not None:
        raise error
    return {"buckets": sent, "bytes": nbytes, "delivery_wait_s": round(waited, 6)}
