"""Benchmark: the cost of cutting optimizer steps from the whole rollout (miles-core's
``split_steps`` over the DP group, one gather of the shards' sample indices per rollout)
against the old cut of each rank's own shard (a local slice), in one run on gloo ranks.

    python scripts/bench_split_steps.py --ranks 2 --samples 256 4096 --steps 4 --out split.json

Prints a table (median milliseconds per rollout of each, and the difference) and writes JSON;
it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def shard_split(batch, num_steps):
    """The baseline: consecutive slices of this rank's shard (the cut before the fix)."""
    n = len(batch)
    bounds = [n * k // num_steps for k in range(num_steps + 1)]
    return [batch.select(range(bounds[k], bounds[k + 1])) for k in range(num_steps)]


def rank_main(rank, world, init_file, sizes, steps, iters, out_file):
    from miles_core.batch import RolloutBatch, Sample
    from miles_core.micro_batch import split_steps
    from miles_core.partition import partition_for_dp

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")
    rows = []
    for n in sizes:
        g = torch.Generator().manual_seed(n)
        rollout = RolloutBatch(
            [
                Sample(
                    tokens=torch.zeros(
                        int(torch.randint(8, 64, (), generator=g)), dtype=torch.long
                    ),
                    response_length=4,
                    reward=0.0,
                    group_index=i // 8,
                )
                for i in range(n)
            ]
        )
        shard = partition_for_dp(rollout, world, keep_groups=True)[rank]
        times = {"rollout_slices": [], "shard_slices": []}
        for _ in range(iters):
            for name, cut in (
                ("rollout_slices", lambda b=shard: split_steps(b, steps, group)),
                ("shard_slices", lambda b=shard: shard_split(b, steps)),
            ):
                dist.barrier(group)
                t = time.perf_counter()
                cut()
                times[name].append(time.perf_counter() - t)
        med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        rows.append({"samples": n, "ranks": world, "steps": steps, **med})
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--samples", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default="bench_split_steps.json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        rows_file = os.path.join(tmp, "rows.json")
        mp.spawn(
            rank_main,
            args=(args.ranks, os.path.join(tmp, "init"), args.samples, args.steps, args.iters,
                  rows_file),
            nprocs=args.ranks,
        )  # fmt: skip
        with open(rows_file) as f:
            rows = json.load(f)
    print(
        f"{'samples':>8} {'ranks':>5} {'steps':>5} {'rollout ms':>11} {'shard ms':>9} {'diff ms':>8}"
    )
    for r in rows:
        diff = r["rollout_slices"] - r["shard_slices"]
        print(
            f"{r['samples']:>8} {r['ranks']:>5} {r['steps']:>5} {r['rollout_slices']:>11.3f} "
            f"{r['shard_slices']:>9.3f} {diff:>8.3f}"
        )
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
