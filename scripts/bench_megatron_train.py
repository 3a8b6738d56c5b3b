"""Benchmark: MegatronBackend.train vs FSDPBackend.train on one Qwen3-1.7B-shaped random model.

    torchrun --nproc-per-node 1 scripts/bench_megatron_train.py --out bench_megatron_1gpu.json
    torchrun --nproc-per-node 2 scripts/bench_megatron_train.py --tp 2 --out bench_megatron_2gpu.json

Both backends train the same random model (written once as a HF directory; megatron converts it
in memory through its bridge) on the same synthetic rollouts (``--tokens-per-gpu`` tokens per GPU
per optimizer step, THD-packed by miles-core), bf16 with fp32 master weights and reduction.
Reported per backend: tokens/s per GPU, MFU (``6 N + 6 L h d s`` FLOPs per token against
``--peak-tflops``), peak memory. Prints a table and writes JSON; asserts nothing about speed.
Megatron runs its local (non-TransformerEngine) spec; its attention is torch's SDPA with a
boolean block-causal mask (``T^2`` bytes per micro-batch, the scores are not stored).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import train_bench_model as bench  # noqa: E402  (same-directory module)


def run(name: str, hf_dir: str, shard, args, world: int) -> list[float]:
    from miles_core.args import core_groups, parse_args
    from miles_core.backends import load

    cls = load(name)
    argv = ["--hf-checkpoint", hf_dir, "--bf16", "--lr", "1e-6", "--advantage-estimator", "grpo"]
    argv += ["--use-dynamic-batch-size", "--max-tokens-per-gpu", str(args.tokens_per_gpu)]
    argv += ["--num-steps-per-rollout", str(args.steps)]
    if name == "megatron":
        argv += ["--tensor-model-parallel-size", str(args.tp)]
        argv += ["--sequence-parallel"] if args.tp > 1 else []
        if args.gradient_checkpointing:
            argv += ["--recompute-granularity", "full", "--recompute-method", "uniform"]
            argv += ["--recompute-num-layers", "1"]
    elif args.gradient_checkpointing:
        argv += ["--gradient-checkpointing"]
    say(f"{name}: building the backend (world {world})")
    start = time.perf_counter()
    backend = cls()
    backend.init(parse_args(argv, [*core_groups(), *cls.arg_groups()]))
    say(f"{name}: ready after {time.perf_counter() - start:.1f} s; training")
    shard = shard if backend.data_layout().consumes_data else None

    def report(rollout: int, seconds: float) -> None:
        say(f"{name}: rollout {rollout + 1}/{args.warmup + args.iters} {seconds:.3f} s")

    times = bench.time_train(backend, shard, args.warmup, args.iters, report=report)
    backend.close()
    return times


def say(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"bench_megatron_train: {message}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="megatron,fsdp")
    parser.add_argument("--tp", type=int, default=1, help="megatron tensor-parallel size")
    bench.add_timing_flags(parser)
    parser.add_argument("--out", default="bench_megatron_train.json")
    parser.add_argument(
        "--stack-dump-s",
        type=float,
        default=0,
        help="print every thread's stack every N seconds (finding where a slow run spends time)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.stack_dump_s:
        faulthandler.dump_traceback_later(args.stack_dump_s, repeat=True)

    rank, world = bench.init_nccl()
    size = args.size or "1.7B"
    peak = bench.peak_tflops(args)
    say(f"bf16 matmul peak {peak:.0f} TFLOP/s (the MFU denominator); writing a random "
        f"Qwen3-{size}-shaped checkpoint")  # fmt: skip
    cfg = bench.qwen3_config(size)
    hf_dir = bench.shared_model_dir(cfg, prefix="bench_megatron_")
    results = {}
    for name in args.backends.split(","):
        dp = world // args.tp if name == "megatron" else world
        rollout = bench.make_rollout(args.tokens_per_gpu, dp, args.steps, seed=1)
        from miles_core.partition import partition_for_dp

        dp_rank = rank // args.tp if name == "megatron" else rank
        shard = partition_for_dp(rollout, dp, keep_groups=True)[dp_rank]
        torch.cuda.reset_peak_memory_stats()
        times = run(name, hf_dir, shard, args, world)
        tokens = rollout.total_tokens / world  # per GPU
        seconds = statistics.median(times)
        mean_len = rollout.total_tokens / len(rollout)
        mfu = tokens * bench.flops_per_token(cfg, mean_len) / seconds / (args.peak_tflops * 1e12)
        results[name] = {
            "tokens_per_s_per_gpu": tokens / seconds,
            "mfu": mfu,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
            "seconds_per_rollout": seconds,
        }
    if rank == 0:
        print(f"{'backend':10s} {'tok/s/GPU':>10s} {'MFU':>6s} {'peak GiB':>9s}  (world {world})")
        for name, r in results.items():
            print(
                f"{name:10s} {r['tokens_per_s_per_gpu']:10.0f} {r['mfu']:6.1%} "
                f"{r['peak_memory_gib']:9.1f}"
            )
        Path(args.out).write_text(
            json.dumps(
                {
                    "world": world,
                    "tp": args.tp,
                    "size": size,
                    "bf16_peak_tflops_measured": peak,
                    **results,
                },
                indent=2,
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
