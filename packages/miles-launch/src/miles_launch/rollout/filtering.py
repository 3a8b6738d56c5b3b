"""Dynamic filtering (``--dynamic-filter``): drop prompt groups without a learning signal.

A group whose samples all have the same reward has zero group-relative advantage under GRPO,
so it costs compute and teaches nothing; such groups are dropped and more prompts are drawn.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Rewards closer than this count as equal.
REWARD_TOLERANCE = 1e-9


def has_signal(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards are not all equal."""
    return max(rewards) - min(rewards) > REWARD_TOLERANCE
