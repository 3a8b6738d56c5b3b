"""Karmarkar-Karp partitioning and the data-parallel split."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from miles_core.batch import RolloutBatch, Sample
from miles_core.partition import karmarkar_karp, partition_for_dp


def _sums(weights, parts):
    return [sum(weights[i] for i in p) for p in parts]


@pytest.mark.parametrize("equal_size", [False, True])
def test_kk_is_a_partition_within_the_imbalance_bound(equal_size):
    """max - min subset sum never exceeds the largest weight (the differencing-method bound)."""
    rng = random.Random(0)
    for _ in range(400):
        k = rng.randint(1, 8)
        n = k * rng.randint(0, 6) if equal_size else rng.randint(0, 40)
        weights = [rng.choice([rng.randint(1, 4000), rng.randint(1, 30)]) for _ in range(n)]
        parts = karmarkar_karp(weights, k, equal_size=equal_size)
        assert len(parts) == k
        assert sorted(i for p in parts for i in p) == list(range(n))
        if equal_size:
            assert all(len(p) == n // k for p in parts)
        if n:
            sums = _sums(weights, parts)
            assert max(sums) - min(sums) <= max(weights)


def test_kk_near_optimal_on_small_instances():
    """Against brute force: KK's largest subset is within one max weight of the optimum, and it
    beats round-robin on average."""
    rng = random.Random(1)
    kk_total = rr_total = 0
    for _ in range(60):
        n, k = rng.randint(2, 9), rng.randint(2, 3)
        w = [rng.randint(1, 100) for _ in range(n)]
        best = min(
            max(_sums(w, [[i for i in range(n) if a[i] == j] for j in range(k)]))
            for a in itertools.product(range(k), repeat=n)
        )
        kk = max(_sums(w, karmarkar_karp(w, k)))
        rr = max(_sums(w, [list(range(j, n, k)) for j in range(k)]))
        assert best <= kk <= best + max(w)
        kk_total += kk - best
        rr_total += rr - best
    assert kk_total < rr_total


def test_kk_ties_and_errors():
    parts = karmarkar_karp([5] * 8, 4)
    assert _sums([5] * 8, parts) == [10] * 4
    assert karmarkar_karp([], 3) == [[], [], []]
    with pytest.raises(ValueError, match="divisible"):
        karmarkar_karp([1, 2, 3], 2, equal_size=True)


def _batch(lengths, group_size):
    return RolloutBatch(
        [
            Sample(
                tokens=torch.zeros(n, dtype=torch.long),
                response_length=1,
                reward=0.0,
                group_index=i // group_size,
            )
            for i, n in enumerate(lengths)
        ]
    )


def test_partition_for_dp_keeps_groups_and_balances():
    rng = random.Random(2)
    lengths = [rng.randint(2, 500) for _ in range(48)]
    batch = _batch(lengths, group_size=4)
    shards = partition_for_dp(batch, 4, keep_groups=True)
    seen = []
    for shard in shards:
        groups = set(shard.group_indices)
        for g in groups:  # every group entirely on this shard
            assert sum(1 for s in shard if s.group_index == g) == 4
        assert list(shard.source_indices) == sorted(shard.source_indices)
        seen += shard.source_indices
    assert sorted(seen) == list(range(48))
    group_tokens = [sum(lengths[4 * g : 4 * g + 4]) for g in range(12)]
    totals = [s.total_tokens for s in shards]
    assert max(totals) - min(totals) <= max(group_tokens)


def test_partition_for_dp_per_sample_equal_size():
    lengths = list(range(2, 26))
    shards = partition_for_dp(_batch(lengths, 3), 4, keep_groups=False, equal_size=True)
    assert [len(s) for s in shards] == [6] * 4
    totals = [s.total_tokens for s in shards]
    assert max(totals) - min(totals) <= max(lengths)
    with pytest.raises(ValueError, match="same number of prompt groups"):
        partition_for_dp(_batch(lengths, 3), 3, keep_groups=True, equal_size=True)


def test_partition_for_dp_balances_each_optimizer_step():
    """With ``num_steps`` each step's groups (by their first sample) are balanced on their own:
    the tokens of step k on each rank differ by at most the heaviest group of that step."""
    rng = random.Random(3)
    lengths = [rng.randint(2, 500) for _ in range(48)]
    batch = _batch(lengths, group_size=4)  # 12 groups; steps of 16 samples: 4 groups each
    shards = partition_for_dp(batch, 2, keep_groups=True, num_steps=3)
    assert sorted(i for s in shards for i in s.source_indices) == list(range(48))
    for k in range(3):
        step = range(16 * k, 16 * (k + 1))
        loads = [sum(lengths[i] for i in s.source_indices if i in step) for s in shards]
        heaviest = max(sum(lengths[i : i + 4]) for i in range(16 * k, 16 * (k + 1), 4))
        assert abs(loads[0] - loads[1]) <= heaviest, (k, loads)
    for shard in shards:  # groups whole
        for g in set(shard.group_indices):
            assert shard.group_indices.count(g) == 4
    with pytest.raises(ValueError, match="the batch has 3 in optimizer step 0"):
        partition_for_dp(_batch(lengths[:24], 4), 2, keep_groups=True, equal_size=True, num_steps=2)
