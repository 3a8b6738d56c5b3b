"""Drawing one rollout's prompt groups from the prompt stream (the synchronous loop).

Every prompt drawn advances ``state.data_position``, kept or not, so a resumed run draws what
an uninterrupted one would. Which groups are kept is :class:`~miles_launch.rollout.filtering.
GroupFilter`'s decision (``--dynamic-filter``), shared with the asynchronous producer. Under
``--partial-rollout`` the groups carried from the previous rollout
(:class:`~miles_launch.rollout.partial.PartialBuffer`) open the first draw, and the groups a draw
cuts short go back to the buffer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from miles_launch.job import LauncherState
from miles_launch.rollout.filtering import GroupFilter
from miles_launch.rollout.generate import GeneratedSample
from miles_launch.rollout.partial import PartialBuffer, unfinished

logger = logging.getLogger(__name__)


def draw_groups(
    state: LauncherState,
    items_at: Callable[[int, int], list[tuple[Any, int]]],
    generate: Callable[[list[tuple[Any, int]]], list[list[GeneratedSample]]],
    *,
    want: int,
    max_draws: int,
    dynamic_filter: bool | GroupFilter,
    over_sampling: int | None = None,
    partial: PartialBuffer | None = None,
) -> tuple[list[list[GeneratedSample]], dict]:
    """Draw prompt groups from the stream at ``state.data_position`` until ``want`` are kept.

    Without ``dynamic_filter``: the next ``want`` prompts, once. With it (a flag, or the job's
    :class:`GroupFilter` with its rule): groups whose rewards are all equal (or that the rule
    rejects) are dropped and prompts are drawn again, at most ``max_draws`` times in all;
    each draw is the number of groups still missing, or ``over_sampling`` groups
    (``--over-sampling-batch-size``) of which the first passing ones in stream order are kept
    (the passing rest is counted in ``groups_surplus``). When nothing survived, the last draw
    is used unfiltered (its advantages are zero, the step is a no-op for the policy loss).

    With ``partial`` (``--partial-rollout``) a draw takes the carried groups first, and
    ``generate(items, carried, need)`` stops once ``need`` groups passed; the groups it cut
    short are put back (``groups_carried``; ``groups_resumed``: those taken from the buffer;
    ``samples_continued``: kept samples that began in an earlier rollout).
    """
    if isinstance(dynamic_filter, GroupFilter):
        group_filter = dynamic_filter
    else:
        group_filter = GroupFilter(dynamic_filter)
    kept: list[list[GeneratedSample]] = []
    surplus = draws = 0
    last: list[list[GeneratedSample]] = []
    resumed = carried_out = 0
    while len(kept) < want and draws < max_draws:
        count = max(want - len(kept), over_sampling or 0)
        draws += 1
        if partial is None:
            items = items_at(state.data_position, count)
            state.data_position += count
            last = generate(items)
        else:
            taken = partial.take(count)
            resumed += len(taken)
            fresh = items_at(state.data_position, count - len(taken))
            state.data_position += count - len(taken)
            items = [(prompt, position) for prompt, position, _ in taken] + fresh
            carried = {position: samples for _, position, samples in taken}
            last = generate(items, carried, want - len(kept))
        for group in last:
            if partial is not None and unfinished(group):
                partial.put(group)
                carried_out += 1
                continue
            if not group_filter.keep(group):
                continue
            if len(kept) < want:
                kept.append(group)
            else:
                surplus += 1
    if not kept:
        logger.warning("every group was filtered out; training on the last draw")
        kept = [group for group in last if not unfinished(group)][:want]
    info = {"groups_dropped": group_filter.dropped, "draws": draws}
    if over_sampling:
        info["groups_surplus"] = surplus
    if partial is not None:
        info["groups_resumed"] = resumed
        info["groups_carried"] = carried_out
        info["samples_continued"] = sum(1 for g in kept for s in g if s.resumed_tokens)
    return kept, info
