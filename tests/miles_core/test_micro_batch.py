"""Dynamic micro-batching under the token budget, and the agreed count across gloo ranks."""

from __future__ import annotations

import os
import random
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from miles_core.batch import RolloutBatch, Sample
from miles_core.micro_batch import (
    MicroBatching,
    agree_num_micro_batches,
    count_micro_batches,
    first_fit_decreasing,
    fixed_size_micro_batches,
    make_micro_batches,
    micro_batch_budget,
    split_micro_batches,
    split_steps,
)
from miles_core.partition import karmarkar_karp
from miles_core.ports import free_port
from rank_context import in_environ, rank_context


def _batch(lengths):
    return RolloutBatch(
        [
            Sample(tokens=torch.zeros(n, dtype=torch.long), response_length=1, reward=0.0)
            for n in lengths
        ]
    )


def _check(batch, mbs, budget, num):
    assert len(mbs) == num
    seen = []
    for mb in mbs:
        assert mb.total_tokens <= budget
        assert list(mb.source_indices) == sorted(mb.source_indices)
        seen += mb.source_indices
    assert sorted(seen) == list(range(len(batch)))


def test_micro_batches_respect_budget_and_count():
    rng = random.Random(0)
    for _ in range(200):
        budget = rng.randint(50, 400)
        lengths = [rng.randint(2, budget) for _ in range(rng.randint(0, 30))]
        batch = _batch(lengths)
        need = count_micro_batches(batch, budget)
        assert need == max(len(first_fit_decreasing(lengths, budget)), 1)
        assert need >= -(-sum(lengths) // budget)  # never fewer than the volume bound
        _check(batch, make_micro_batches(batch, budget), budget, need)
        more = need + rng.randint(0, 5)  # another DP rank needed more: we must match it
        _check(batch, make_micro_batches(batch, budget, num=more), budget, more)


def test_tight_budget_falls_back_to_first_fit():
    # 38 tokens in 3 micro-batches of 13: Karmarkar-Karp's balanced split overflows one of them,
    # first-fit decreasing finds {12}, {9, 4}, {8, 3, 2}
    lengths = [9, 12, 2, 4, 3, 8]
    assert max(sum(lengths[i] for i in p) for p in karmarkar_karp(lengths, 3)) > 13
    mbs = make_micro_batches(_batch(lengths), 13, num=3)
    got = sorted(sorted(lengths[i] for i in mb.source_indices) for mb in mbs)
    assert got == [[2, 3, 8], [4, 9], [12]]


def test_fewer_samples_than_micro_batches_gives_empty_ones():
    mbs = make_micro_batches(_batch([5, 7]), 100, num=4)
    assert [len(mb) for mb in mbs] == [1, 1, 0, 0]
    assert len(make_micro_batches(_batch([]), 100)) == 1


def test_context_parallel_multiplies_the_budget_and_errors_name_flags():
    batch = _batch([300, 300, 300, 300])
    assert count_micro_batches(batch, 300) == 4
    assert count_micro_batches(batch, 300, cp_size=2) == 2
    assert micro_batch_budget(300, 4) == 1200
    with pytest.raises(ValueError, match="sample 1 has 300 tokens.*--max-tokens-per-gpu"):
        count_micro_batches(_batch([10, 300]), 200)
    with pytest.raises(ValueError, match="2 are needed"):
        make_micro_batches(batch, 600, num=1)
    with pytest.raises(ValueError, match="--context-parallel-size"):
        micro_batch_budget(10, 0)


def test_fixed_size_micro_batches():
    batch = _batch(list(range(2, 9)))
    mbs = fixed_size_micro_batches(batch, 3)
    assert [list(mb.source_indices) for mb in mbs] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [len(mb) for mb in fixed_size_micro_batches(batch, 3, num=4)] == [3, 3, 1, 0]
    with pytest.raises(ValueError, match="--micro-batch-size"):
        fixed_size_micro_batches(batch, 3, num=2)


def test_split_micro_batches_one_rank():
    batch = _batch([50, 120, 30, 90, 60])
    dynamic = split_micro_batches(batch, MicroBatching(True, 150, 1))
    assert len(dynamic) == count_micro_batches(batch, 150) == 3
    assert all(mb.total_tokens <= 150 for mb in dynamic)
    assert sorted(i for mb in dynamic for i in mb.source_indices) == list(range(5))
    # context parallelism multiplies the budget: 300 tokens hold the batch in 2
    assert len(split_micro_batches(batch, MicroBatching(True, 150, 1, cp_size=2))) == 2
    fixed = split_micro_batches(batch, MicroBatching(False, None, 2))
    assert [list(mb.source_indices) for mb in fixed] == [[0, 1], [2, 3], [4]]
    assert len(split_micro_batches(_batch([]), MicroBatching(False, None, 2))) == 1
    with pytest.raises(ValueError, match="--use-dynamic-batch-size needs --max-tokens-per-gpu"):
        split_micro_batches(batch, MicroBatching(True, None, 1))
    with pytest.raises(ValueError, match="--micro-batch-size must be >= 1, got 0"):
        split_micro_batches(batch, MicroBatching(False, None, 0))


def test_micro_batching_from_the_algorithm_group():
    from miles_core.args.groups import AlgorithmArgs

    group = AlgorithmArgs(use_dynamic_batch_size=True, max_tokens_per_gpu=64, micro_batch_size=2)
    assert MicroBatching.from_algorithm(group, cp_size=2) == MicroBatching(True, 64, 2, 2)


def test_split_steps():
    steps = split_steps(_batch(list(range(2, 12))), 3)
    assert [len(s) for s in steps] == [3, 3, 4]
    assert [i for s in steps for i in s.source_indices] == list(range(10))
    with pytest.raises(ValueError, match="--num-steps-per-rollout"):
        split_steps(_batch([3]), 0)
    # a shard: the steps are the rollout's slices, by source index, not the shard's halves
    shard = _batch(list(range(2, 12))).select([0, 1, 2, 7, 8, 9])
    assert [list(s.source_indices) for s in split_steps(shard, 2)] == [[0, 1, 2], [7, 8, 9]]
    assert [len(s) for s in split_steps(_batch([3, 4]), 3)] == [0, 1, 1]  # fewer than steps
    with pytest.raises(ValueError, match="share samples"):
        split_steps(_batch([3, 4, 5]).select([0, 1, 1]), 2)


def _steps_worker(rank, world, port, out_dir):
    from miles_core.partition import partition_for_dp

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    try:
        group = dist.new_group(backend="gloo")
        rollout = RolloutBatch(
            [
                Sample(
                    tokens=torch.zeros(n, dtype=torch.long),
                    response_length=1,
                    reward=0.0,
                    group_index=i // 3,
                )
                for i, n in enumerate([9, 3, 5, 7, 2, 8, 4, 6, 3, 5, 9, 2])
            ]
        )
        shard = partition_for_dp(rollout, world, keep_groups=True)[rank]
        steps = {n: [list(s.source_indices) for s in split_steps(shard, n, group)] for n in (2, 3)}
        # every rank holding the whole rollout: replicas, each trains all of every step
        replicated = [list(s.source_indices) for s in split_steps(rollout, 2, group)]
        overlap = rollout.select(range(0, 6) if rank == 0 else range(3, 9))
        try:  # shards that overlap without being equal: not shards of one rollout
            split_steps(overlap, 2, group)
            shared = ""
        except ValueError as error:
            shared = str(error)
        out = {"steps": steps, "replicated": replicated, "shared": shared}
        torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_steps_are_the_rollouts_slices_at_any_dp_size(tmp_path):
    """At DP 2 (groups of 3 balanced over the ranks by tokens), the union of the ranks' parts
    of step k is the rollout's k-th slice, as at one rank; each rank's part keeps shard order."""
    results = _two_gloo_ranks(_steps_worker, tmp_path)
    for n in (2, 3):
        one_rank = [list(s.source_indices) for s in split_steps(_batch([2] * 12), n)]
        for k, expected in enumerate(one_rank):
            got = sorted(i for r in results for i in r["steps"][n][k])
            assert got == expected, (n, k, results)
    assert all("share samples" in r["shared"] for r in results)
    whole = [list(s.source_indices) for s in split_steps(_batch([2] * 12), 2)]
    assert all(r["replicated"] == whole for r in results)


def _two_gloo_ranks(worker, tmp_path) -> list[dict]:
    """Run ``worker(rank, 2, port, out_dir)`` on 2 spawned gloo ranks; each rank's saved dict."""
    ctx = rank_context()
    port = free_port()
    procs = [
        ctx.Process(target=in_environ(worker), args=(r, 2, port, str(tmp_path))) for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
        assert p.exitcode == 0
    return [torch.load(tmp_path / f"{r}.pt", weights_only=True) for r in range(2)]


def _agree_worker(rank, world, port, out_dir):
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    try:
        lengths = [[100] * 3, [100] * 9][rank]
        batch = _batch(lengths)
        local = count_micro_batches(batch, 200)
        num = agree_num_micro_batches(local, group=dist.new_group(backend="gloo"))
        mbs = make_micro_batches(batch, 200, num=num)
        group = dist.new_group(backend="gloo")
        split = {
            "dynamic": split_micro_batches(batch, MicroBatching(True, 200, 1), group),
            "fixed": split_micro_batches(batch, MicroBatching(False, None, 4), group),
        }
        torch.save(
            {
                "local": local,
                "num": num,
                "sizes": [mb.total_tokens for mb in mbs],
                "split": {k: [list(mb.source_indices) for mb in v] for k, v in split.items()},
            },
            os.path.join(out_dir, f"{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_agree_on_the_maximum(tmp_path):
    results = _two_gloo_ranks(_agree_worker, tmp_path)
    assert [r["local"] for r in results] == [2, 5]
    assert all(r["num"] == 5 and len(r["sizes"]) == 5 for r in results)
    assert sorted(results[0]["sizes"]) == [0, 0, 100, 100, 100]
    # split_micro_batches: the same agreed count in both modes, every sample exactly once
    for r, n in zip(results, (3, 9)):
        for mode, count in (("dynamic", 5), ("fixed", 3)):
            bins = r["split"][mode]
            assert len(bins) == count, (mode, bins)
            assert sorted(i for b in bins for i in b) == list(range(n))
    assert results[0]["split"]["fixed"] == [[0, 1, 2], [], []]
    assert results[1]["split"]["fixed"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    assert all(len(b) <= 2 for b in results[1]["split"]["dynamic"])  # 200 tokens: 2 samples
    assert agree_num_micro_batches(3) == 3  # no process group: the local count
