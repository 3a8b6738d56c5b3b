"""``--update-weight-transfer-mode p2p``: every trainer rank sends its own share of the buckets.

Each rank ``r`` is rank 0 of its own weight-update group ``<name>_p2p_<r>`` with every engine,
and drives its own ``/update_weights_from_distributed`` calls for buckets ``i`` with
``i % world_size == r``. All ranks send concurrently, so no single rank carries all the bytes,
and the engines see nothing outside SGLang's API (several named groups). Rank 0 still drives
the publish round (pause, version, continue). Not for ``--colocate`` (use ``ipc``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from miles_core.engine import EngineClient

from miles_sync.broadcast import GroupTransport
from miles_sync.group_push import push_buckets


class P2PTransport(GroupTransport):
    """This rank's group with every engine, and the buckets this rank owns."""

    def group_name(self) -> str:
        return f"{self.settings.group_name}_p2p_{self.ctx.rank}"

    def connect(self, engines: Sequence[EngineClient]) -> None:
        self._form(engines, self.group_name())

    def owns(self, index: int) -> bool:
        return index % self.ctx.world_size == self.ctx.rank

    def push(self, source: Iterable[tuple[str, torch.Tensor]]) -> dict:
        return push_buckets(
            source, self.group, buffer_size=self.buffer_size, device=self.device(), owns=self.owns
        )
