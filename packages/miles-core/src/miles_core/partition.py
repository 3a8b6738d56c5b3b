"""Splitting a rollout across data-parallel ranks with balanced token counts.

:func:`karmarkar_karp` is the k-way largest differencing method (Karmarkar & Karp, 1982):
every item starts as a partial k-way partition (the item alone in one of k subsets); the two
partial partitions with the largest spread (max subset sum - min subset sum) are repeatedly
merged, pairing the heaviest subset of one with the lightest of the other, until one is left.
Its final spread is at most the largest item weight (tests check this bound).

:func:`partition_for_dp` applies it to a :class:`~miles_core.batch.RolloutBatch`, either sample by
sample or prompt group by prompt group (``keep_groups``) so that group statistics (GRPO
advantages) can be computed on one rank.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Sequence

from miles_core.batch import RolloutBatch, group_members


def karmarkar_karp(
    weights: Sequence[int | float], k: int, equal_size: bool = False
) -> list[list[int]]:
    """Partition item indices ``0..len(weights)-1`` into ``k`` lists with near-equal weight sums.

    With ``equal_size`` every list receives exactly ``len(weights) / k`` items (which must divide
    evenly): items are sorted by weight and seeded ``k`` at a time, one per subset, so every
    merge keeps the subset sizes equal. Each returned list is sorted ascending.
    """
    if k < 1:
        raise ValueError(f"karmarkar_karp: k must be >= 1, got {k}")
    n = len(weights)
    if equal_size and n % k != 0:
        raise ValueError(
            f"karmarkar_karp: equal_size needs len(weights) ({n}) divisible by k ({k})"
        )
    if n == 0:
        return [[] for _ in range(k)]
    order = sorted(range(n), key=lambda i: (weights[i], i), reverse=True)
    counter = itertools.count()
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []

    def push(subsets: list[tuple[float, list[int]]]) -> None:
        subsets.sort(key=lambda s: (s[0], len(s[1])), reverse=True)
        spread = subsets[0][0] - subsets[-1][0]
        heapq.heappush(heap, (-spread, next(counter), subsets))

    if equal_size:
        for start in range(0, n, k):
            chunk = order[start : start + k]
            push([(float(weights[i]), [i]) for i in chunk])
    else:
        for i in order:
            push([(float(weights[i]), [i])] + [(0.0, []) for _ in range(k - 1)])

    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # a and b are sorted heaviest first: pair a's heaviest with b's lightest.
        merged = [(a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)]
        push(merged)
    _, _, final = heap[0]
    return sorted((sorted(items) for _, items in final), key=lambda items: items[:1])


def partition_for_dp(
    batch: RolloutBatch,
    dp_size: int,
    keep_groups: bool = True,
    equal_size: bool = False,
    num_steps: int = 1,
) -> list[RolloutBatch]:
    """Split ``batch`` into ``dp_size`` shards balancing total token counts (prompt + response).

    With ``keep_groups`` whole prompt groups (same ``group_index``) are the unit of assignment;
    otherwise single samples are. With ``equal_size`` every shard gets the same number of units
    (then the number of units must be divisible by ``dp_size``). Shard ``r`` is for DP rank ``r``;
    its samples keep their original order and its ``source_indices`` point into ``batch``.

    ``num_steps`` (``--num-steps-per-rollout``): the tokens are balanced per optimizer step.
    Step ``k`` trains the batch's ``k``-th slice of samples
    (:func:`~miles_core.micro_batch.split_steps`), so each unit is counted in the step of its
    first sample and each step's units are partitioned on their own (with ``equal_size``, the
    equal counts hold per step); a step then keeps every rank about equally busy. Any
    assignment trains the same samples per step: this only balances the work.
    """
    if dp_size < 1:
        raise ValueError(f"partition_for_dp: dp_size must be >= 1, got {dp_size}")
    if num_steps < 1:
        raise ValueError(f"partition_for_dp: num_steps must be >= 1, got {num_steps}")
    lengths = batch.total_lengths
    if keep_groups:
        units = list(group_members(batch.group_indices).values())
    else:
        units = [[i] for i in range(len(batch))]
    n = len(batch)
    bounds = [n * k // num_steps for k in range(num_steps + 1)]
    per_step: list[list[int]] = [[] for _ in range(num_steps)]
    for u, unit in enumerate(units):
        per_step[bisect.bisect_right(bounds, min(unit)) - 1].append(u)
    what = "prompt groups" if keep_groups else "samples"
    assigned: list[list[int]] = [[] for _ in range(dp_size)]
    for k, step_units in enumerate(per_step):
        if equal_size and len(step_units) % dp_size != 0:
            where = f" in optimizer step {k}" if num_steps > 1 else ""
            raise ValueError(
                f"cannot give each of {dp_size} data-parallel ranks the same number of {what}: "
                f"the batch has {len(step_units)}{where}"
            )
        weights = [sum(lengths[i] for i in units[u]) for u in step_units]
        for rank, part in enumerate(karmarkar_karp(weights, dp_size, equal_size=equal_size)):
            assigned[rank] += [step_units[j] for j in part]
    return [batch.select(sorted(i for u in part for i in units[u])) for part in assigned]
