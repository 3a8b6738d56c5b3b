"""A weight-update process group between one trainer rank and the engines, made as SGLang does.

The trainer rank is rank 0 and hosts a ``TCPStore``; the group is built on
``PrefixStore(group_name, store)`` with torch's group helper (SGLang's
``init_custom_process_group`` does the same on the engine side, so the rendezvous keys agree).
Engine ``i`` (of ``gpus_per_engine`` TP workers) joins as ranks
``1 + i * gpus_per_engine ... (i + 1) * gpus_per_engine``, through
``POST /init_weights_update_group``, which blocks until everyone joined: those calls are issued
concurrently with the trainer's own join. The group needs no default process group.

The store's address (the group's master address) is the publishing rank's node address, the one
the engines reach it on (:func:`node_address`), never a loopback default: an engine on another
host would look for the store on its own loopback.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from miles_core.engine import EngineClient, EngineError
from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

from miles_sync.errors import PublishError
from miles_sync.node_address import node_address

logger = logging.getLogger(__name__)


def default_backend() -> str:
    """nccl when CUDA is available, else gloo."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def engine_rank_offset(engine_index: int, gpus_per_engine: int) -> int:
    """Group rank of engine ``engine_index``'s first TP worker: ``1 + i * gpus_per_engine``."""
    return 1 + engine_index * gpus_per_engine


def host_store(
    master_address: str, master_port: int, world_size: int, timeout: datetime.timedelta
) -> Any:
    """Rank 0's store, listening before any engine is told where: port 0 lets the OS pick a
    free one (``store.port``), so no other process can take it between the pick and the bind."""
    return dist.TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,
    )


def join_as_master(
    store: Any,
    world_size: int,
    group_name: str,
    backend: str,
    timeout: datetime.timedelta,
) -> Any:
    """Rank 0's side: build the group on ``PrefixStore(group_name, store)`` (the store of
    :func:`host_store`)."""
    store = dist.PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, 0, [], Backend(backend), store, group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


@dataclass
class EngineGroup:
    """A formed group: rank 0 is this trainer rank, the engines follow."""

    name: str
    pg: Any
    engines: list[EngineClient]
    world_size: int
    backend: str
    _closed: bool = field(default=False, repr=False)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Send ``tensor`` from rank 0 (this rank) to every engine worker."""
        dist.broadcast(tensor, src=0, group=self.pg)

    def close(self, tell_engines: bool = True) -> None:
        """Destroy the trainer's side and (best effort) ask live engines to destroy theirs.

        The engines' ``/destroy_weights_update_group`` calls run concurrently with the trainer's
        own ``destroy_process_group``: tearing down an NCCL communicator waits for its peers, so
        doing one side after the other would stall until the first call's timeout.
        """
        if self._closed:
            return
        self._closed = True
        pool = concurrent.futures.ThreadPoolExecutor(max(1, len(self.engines)))
        asked = []
        if tell_engines:
            asked = [
                (engine, pool.submit(engine.destroy_weights_update_group, self.name, timeout=30))
                for engine in self.engines
            ]
        try:
            dist.destroy_process_group(self.pg)
        except Exception as error:  # a group broken by a dead peer may refuse a clean shutdown
            logger.info("destroying weight-update group %s: %s", self.name, error)
        for engine, reply in asked:
            try:
                reply.result()
            except EngineError as error:
                logger.info("destroy_weights_update_group on %s: %s", engine.base_url, error)
        pool.shutdown(wait=True)


def form_engine_group(
    engines: Sequence[EngineClient],
    *,
    group_name: str,
    gpus_per_engine: int = 1,
    master_address: str | None = None,
    master_port: int | None = None,
    backend: str | None = None,
    timeout_s: float = 600.0,
) -> EngineGroup:
    """Make the group: trainer rank 0 plus every engine's TP workers.

    ``world_size = 1 + len(engines) * gpus_per_engine``; ``master_address`` None: this node's
    address as the first engine reaches it (:func:`node_address`). Raises :class:`PublishError` naming the
    engine whose ``/init_weights_update_group`` failed.
    """
    backend = backend or default_backend()
    master_address = master_address or node_address(engines[0].base_url)
    world_size = 1 + len(engines) * gpus_per_engine
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = host_store(master_address, master_port or 0, world_size, timeout)
    except Exception as error:
        raise PublishError(
            f"weight-update group {group_name!r}: its store could not listen on "
            f"{master_address}:{master_port or 0}: {error}"
        ) from error
    port = store.port
    pool = concurrent.futures.ThreadPoolExecutor(max(1, len(engines)))
    try:
        joins = {
            pool.submit(
                engine.init_weights_update_group,
                master_address,
                port,
                engine_rank_offset(i, gpus_per_engine),
                world_size,
                group_name=group_name,
                backend=backend,
                timeout=timeout_s,
            ): engine
            for i, engine in enumerate(engines)
        }
        try:
            pg = join_as_master(store, world_size, group_name, backend, timeout)
        except Exception as error:
            failed = [
                f"{joins[f].base_url}: {f.exception()}"
                for f in joins
                if f.done() and f.exception() is not None
            ]
            raise PublishError(
                f"weight-update group {group_name!r} ({backend}, {world_size} ranks at "
                f"{master_address}:{port}) could not be formed: {error}"
                + (f"; engines said: {'; '.join(failed)}" if failed else "")
            ) from error
        for future, engine in joins.items():
            try:
                future.result(timeout=timeout_s)
            except EngineError as error:
                dist.destroy_process_group(pg)
                raise PublishError(
                    f"engine {engine.base_url} could not join weight-update group "
                    f"{group_name!r}: {error}"
                ) from error
    finally:
        pool.shutdown(wait=False)
    logger.info(
        "weight-update group %s: %d engines, world size %d, %s",
        group_name,
        len(engines),
        world_size,
        backend,
    )
    return EngineGroup(group_name, pg, list(engines), world_size, backend)
