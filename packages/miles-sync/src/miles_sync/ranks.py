"""The trainer ranks taking part in a publish, and the few collectives weight sync needs.

A weight source (``Iterable[tuple[str, torch.Tensor]]``) is collective: every rank of
:class:`RankContext` iterates it in lock step (the FSDP source all-gathers shards as it goes) and
every rank sees the full tensors, in checkpoint names and dtypes. miles-sync never imports a
backend; a backend hands its source and its rank context to
:class:`~miles_sync.weight_sync.WeightPublisher`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist


class WeightSource(Protocol):
    """``(hf_name, tensor)`` pairs in checkpoint names and dtypes; iterated by every rank."""

    def __iter__(self) -> Iterable[tuple[str, torch.Tensor]]: ...


@dataclass
class RankContext:
    """This process's place among the trainer ranks.

    ``group`` is the trainer's process group (gloo on CPU, nccl on GPU; ``None``: the default
    group). With ``world_size == 1`` no collective is issued and torch.distributed need not be
    initialised.
    """

    rank: int = 0
    world_size: int = 1
    group: Any = None

    @classmethod
    def from_default_group(cls, group: Any = None) -> RankContext:
        if not dist.is_initialized():
            return cls()
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    @property
    def is_source(self) -> bool:
        """Rank 0 drives the publish round."""
        return self.rank == 0

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of rank ``src`` (a group rank) on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank == src else None]
        global_src = src if self.group is None else dist.get_global_rank(self.group, src)
        dist.broadcast_object_list(box, src=global_src, group=self.group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def first_error(self, error: str | None) -> str | None:
        """The lowest rank's error message (``None`` when no rank failed), on every rank."""
        errors = self.all_gather_object(error)
        for rank, message in enumerate(errors):
            if message is not None:
                return message if self.world_size == 1 else f"rank {rank}: {message}"
        return None
