"""Dynamic filtering (``--dynamic-filter``): drop prompt groups without a learning signal.

A group whose samples all have the same reward has zero group-relative advantage under GRPO,
so it costs compute and teaches nothing; such groups are dropped and more prompts are drawn.
``--dynamic-sampling-filter-path MODULE:FUNC`` replaces that rule: ``FUNC(args, group) ->
bool`` gets a finished prompt group (a list of samples with ``reward``, ``response_ids``,
``loss_mask``, ``prompt``...) and returns True to keep it.
The synchronous loop (:func:`miles_launch.loop.draw_groups`) and the fully asynchronous
producer (:mod:`miles_launch.async_loop`) both decide and count through one
:class:`GroupFilter`.

With ``--over-sampling-batch-size N`` the synchronous loop generates ``N`` groups per draw
(instead of the number still missing) and keeps the first passing ones in stream order; the
passing groups beyond the rollout's need are counted as ``groups_surplus``. The asynchronous
producer keeps ``N`` groups in flight instead of ``--rollout-batch-size``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from miles_core.args.parsed import ParsedArgs
from miles_core.user_functions import load_function

FILTER_FLAG = "--dynamic-sampling-filter-path"

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
    #: the rule (``--dynamic-sampling-filter-path``); unset: :func:`has_signal` of the rewards
    rule: Callable[[Sequence[Any]], bool] | None = None

    def passes(self, group: Sequence[Any]) -> bool:
        """Whether ``group`` passes the rule (nothing counted)."""
        if self.rule is None:
            return has_signal([s.reward for s in group])
        verdict = self.rule(group)
        if not isinstance(verdict, bool):
            raise ValueError(f"{FILTER_FLAG}: expected True or False, got {verdict!r}")
        return verdict

    def keep(self, group: Sequence[Any]) -> bool:
        """Whether ``group`` (samples with a ``reward``) trains; a drop is counted."""
        if self.enabled and not self.passes(group):
            self.dropped += 1
            return False
        return True


def group_filter(args: ParsedArgs) -> GroupFilter:
    """The job's filter: ``--dynamic-filter`` with ``--dynamic-sampling-filter-path``'s rule."""
    rule = None
    if args.dynamic_sampling_filter_path:
        fn = load_function(args.dynamic_sampling_filter_path, FILTER_FLAG)

        def rule(group: Sequence[Any]) -> bool:
            return fn(args, list(group))

    return GroupFilter(args.dynamic_filter, rule=rule)


def groups_in_flight(args: ParsedArgs) -> int:
    """Groups the asynchronous producer keeps in flight: ``--over-sampling-batch-size`` when
    set, else ``--rollout-batch-size``."""
    return args.over_sampling_batch_size or args.rollout_batch_size
