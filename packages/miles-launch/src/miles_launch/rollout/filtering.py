"""Dynamic filtering (``--dynamic-filter``): drop prompt groups without a learning signal.

A group whose samples all have the same reward has zero group-relative advantage under GRPO,
so it costs compute and teaches nothing; such groups are dropped and more prompts are drawn.
The synchronous loop (:func:`miles_launch.loop.draw_groups`) and the fully asynchronous
producer (:mod:`miles_launch.async_loop`) both decide and count through one
:class:`GroupFilter`.

With ``--over-sampling-batch-size N`` the synchronous loop generates ``N`` groups per draw
(instead of the number still missing) and keeps the first passing ones in stream order; the
passing groups beyond the rollout's need are counted as ``groups_surplus``. The asynchronous
producer keeps ``N`` groups in flight instead of ``--rollout-batch-size``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: Rewards closer than this count as equal.
REWARD_TOLERANCE = 1e-9


def has_signal(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards are not all equal."""
    return max(rewards) - min(rewards) > REWARD_TOLERANCE


@dataclass
class GroupFilter:
    """Keeps or drops completed prompt groups (``enabled``: ``--dynamic-filter``) and counts
    the dropped ones."""

    enabled: bool
    dropped: int = 0

    def keep(self, group: Sequence[Any]) -> bool:
        """Whether ``group`` (samples with a ``reward``) trains; a drop is counted."""
        if self.enabled and not has_signal([s.reward for s in group]):
            self.dropped += 1
            return False
        return True


def groups_in_flight(args: Any) -> int:
    """Groups the asynchronous producer keeps in flight: ``--over-sampling-batch-size`` when
    set, else ``--rollout-batch-size``."""
    return args.over_sampling_batch_size or args.rollout_batch_size
