"""``--update-weight-transfer-mode broadcast``: trainer rank 0 broadcasts every bucket to the
engines over one weight-update group (NCCL on GPU, gloo on CPU).

Rank 0 forms the group with all engines (:func:`~miles_sync.engine_group.form_engine_group`)
and re-forms it whenever the engine set changes or a publish failed (a dead peer leaves a group
unusable). Other ranks only take part in iterating the (collective) weight source.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from miles_core.engine import EngineClient

from miles_sync.engine_group import EngineGroup, form_engine_group
from miles_sync.group_push import push_buckets
from miles_sync.ranks import RankContext

logger = logging.getLogger(__name__)


@dataclass
class GroupSettings:
    """How weight-update groups are made (see :func:`form_engine_group`)."""

    gpus_per_engine: int = 1
    master_address: str | None = None  # None: this rank's node address (node_address)
    backend: str | None = None  # None: nccl with CUDA, else gloo
    timeout_s: float = 600.0
    group_name: str = "miles_weight_update"


class GroupTransport:
    """One weight-update group held by this rank, re-made when its engines change."""

    def __init__(self, ctx: RankContext, buffer_size: int, settings: GroupSettings):
        self.ctx = ctx
        self.buffer_size = buffer_size
        self.settings = settings
        self.group: EngineGroup | None = None
        self._engine_key: tuple[str, ...] | None = None
        self._generation = 0

    def _form(self, engines: Sequence[EngineClient], group_name: str) -> None:
        key = tuple(engine.base_url for engine in engines)
        if self.group is not None and key == self._engine_key:
            return
        self.reset()
        # A fresh name per group: a group broken by a dead peer may not release its name.
        self._generation += 1
        self.group = form_engine_group(
            engines,
            group_name=f"{group_name}_{self._generation}",
            gpus_per_engine=self.settings.gpus_per_engine,
            master_address=self.settings.master_address,
            backend=self.settings.backend,
            timeout_s=self.settings.timeout_s,
        )
        self._engine_key = key

    def reset(self) -> None:
        """Drop the group (the next connect forms a new one)."""
        if self.group is not None:
            self.group.close()
        self.group, self._engine_key = None, None

    def device(self) -> torch.device:
        if self.group is not None and self.group.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    close = reset


class BroadcastTransport(GroupTransport):
    """Rank 0 sends every bucket; the engines receive them over one group."""

    def connect(self, engines: Sequence[EngineClient]) -> None:
        if self.ctx.is_source:
            self._form(engines, self.settings.group_name)

    def push(self, source: Iterable[tuple[str, torch.Tensor]]) -> dict:
        if not self.ctx.is_source:
            for _ in source:  # collective source: iterate in lock step, send nothing
                pass
            return {"buckets": 0, "bytes": 0}
        return push_buckets(
            source,
            self.group,
            buffer_size=self.buffer_size,
            device=self.device(),
            owns=lambda index: True,
        )
