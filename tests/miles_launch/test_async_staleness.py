"""``--max-weight-staleness``: the fully async loop trains only on groups whose samples' weights
are at most N versions behind the engines' (the rest dropped and counted), against the rule
written here: a group's staleness is ``version - min(sample versions)``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from miles_launch.async_loop import group_staleness, take_fresh


class Completed:
    """Completed groups in arrival order, as the producer's queue hands them out."""

    def __init__(self, groups):
        self.groups = list(groups)
        self.taken = 0

    def take(self, count):
        out, self.groups = self.groups[:count], self.groups[count:]
        self.taken += len(out)
        return out


def group(*versions):
    return [SimpleNamespace(weight_version=v) for v in versions]


ARRIVALS = [group(3, 3), group(2, 3), group(3), group(1), group(3, None), group(2)]


def test_staleness_is_the_oldest_samples_lag():
    assert [group_staleness(g, 3) for g in ARRIVALS] == [0, 1, 0, 2, 0, 1]
    assert group_staleness(group(None), 3) == 0  # no version reported: not counted stale


@pytest.mark.parametrize(
    ("bound", "kept", "dropped"),
    [
        (None, [0, 1, 2], 0),  # no bound: the first three, as they came
        (0, [0, 2, 4], 2),  # on-policy only: two stale groups dropped on the way
        (1, [0, 1, 2], 0),
    ],
)
def test_take_fresh_keeps_the_first_groups_within_the_bound(bound, kept, dropped):
    producer = Completed(ARRIVALS)
    got, n_dropped = take_fresh(producer, 3, 3, bound)
    assert got == [ARRIVALS[i] for i in kept]
    assert n_dropped == dropped
    assert producer.taken == len(kept) + dropped  # nothing taken and lost beyond those
