"""Benchmark: MegatronBackend.train vs FSDPBackend.train on one Qwen3-1.7B-shaped random model.

    torchrun --nproc-per-node 1 scripts/bench_megatron_train.py --out bench_megatron_1gpu.json
    torchrun --nproc-per-node 2 scripts/bench_megatron_train.py --tp 2 --out bench_megatron_2gpu.json

Both backends train the same random model (written once as a HF directory; megatron converts it
in memory through its bridge) on the same synthetic rollouts (``--tokens-per-gpu`` tokens per GPU
per optimizer step, THD-packed by miles-core), bf16 with fp32 master weights and reduction.
Reported per backend: tokens/s per GPU, MFU (``6 N + 6 L h d s`` FLOPs per token against
``--peak-tflops``), peak memory. Prints a table and writes JSON; asserts nothing about speed.
``--variant "FLAGS"`` (repeatable) runs each backend once per variant with those extra flags,
e.g. ``--variant "" --variant "--use-rollout-logprobs"`` (the samples carry engine-like
log-probs, so the old-log-prob forward that flag removes is measured on the same data with and
without it); a variant's flags come last, so ``--recompute-method block
--recompute-num-layers K`` recomputes K layers instead of every one under
``--gradient-checkpointing`` (Megatron: uniform, one layer a chunk). ``--profile`` profiles
one more rollout of each backend and variant (GPU time by kernel category, idle time).
Megatron runs its local (non-TransformerEngine) spec. ``--attn-implementation varlen|sdpa``
goes to both backends (unset: each backend's default, varlen on a GPU whose torch ships the
varlen kernel): varlen attends each packed sample with itself through torch's varlen flash
kernel, sdpa runs SDPA with a boolean block-causal mask (``T^2`` bytes per micro-batch). Each
backend's line says which it resolved to and how many attention calls ran each kernel.
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import gc
import json
import logging
import shlex
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import train_bench_model as bench  # noqa: E402  (same-directory module)


class KernelCounter:
    """Counts the attention calls that reached each kernel, by wrapping their entry points
    (miles-core's varlen paths; Megatron's masked SDPA and megatron's own forward)."""

    def __init__(self) -> None:
        import miles_core.varlen_attention as va

        self.counts: Counter[str] = Counter()
        self._undo: list[tuple[object, str, object]] = []
        self._wrap(va, "_flash", "varlen flash kernel")
        self._wrap(va, "_per_sample", "varlen per-sample SDPA")
        try:
            import miles_megatron.sdpa_attention as sa
            from megatron.core.transformer.dot_product_attention import DotProductAttention
        except ImportError:
            return
        self._wrap(sa, "sdpa_attend", "masked SDPA")
        self._wrap(DotProductAttention, "forward", "megatron DotProductAttention")

    def _wrap(self, owner: object, attr: str, label: str) -> None:
        original = getattr(owner, attr)

        def counted(*args, **kwargs):
            self.counts[label] += 1
            return original(*args, **kwargs)

        self._undo.append((owner, attr, original))
        setattr(owner, attr, counted)

    def close(self) -> str:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)
        return ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items())) or "none counted"


def resolved_attention(name: str, backend) -> str:
    if name == "megatron":
        from miles_megatron.packed_attention import attn_implementation_of

        return attn_implementation_of(backend.model)
    return str(backend.attn_implementation)


def run(
    name: str, hf_dir: str, shard, args, world: int, extra: list[str]
) -> tuple[list[float], dict]:
    from miles_core.args import core_groups, parse_args
    from miles_core.backends import load

    cls = load(name)
    argv = ["--hf-checkpoint", hf_dir, "--bf16", "--lr", "1e-6", "--advantage-estimator", "grpo"]
    argv += ["--use-dynamic-batch-size", "--max-tokens-per-gpu", str(args.tokens_per_gpu)]
    argv += ["--num-steps-per-rollout", str(args.steps)]
    if args.attn_implementation:
        argv += ["--attn-implementation", args.attn_implementation]
    if name == "megatron":
        argv += ["--tensor-model-parallel-size", str(args.tp)]
        argv += ["--sequence-parallel"] if args.tp > 1 else []
        if args.gradient_checkpointing:
            argv += ["--recompute-granularity", "full", "--recompute-method", "uniform"]
            argv += ["--recompute-num-layers", "1"]
    elif args.gradient_checkpointing:
        argv += ["--gradient-checkpointing"]
    argv += extra
    say(f"{name}: building the backend (world {world}; extra flags: {shlex.join(extra)})")
    start = time.perf_counter()
    backend = cls()
    backend.init(parse_args(argv, [*core_groups(), *cls.arg_groups()]))
    attention = resolved_attention(name, backend)
    say(f"{name}: ready after {time.perf_counter() - start:.1f} s; attention {attention}; training")
    shard = shard if backend.data_layout().consumes_data else None

    def report(rollout: int, seconds: float) -> None:
        say(f"{name}: rollout {rollout + 1}/{args.warmup + args.iters} {seconds:.3f} s")

    counter = KernelCounter()
    try:
        times = bench.time_train(backend, shard, args.warmup, args.iters, report=report)
    finally:
        kernels = counter.close()
    say(f"{name}: attention {attention}; calls per kernel: {kernels}")
    extras = {"attn_implementation": attention, "attention_kernels": kernels}
    from miles_core.compiled_layers import coverage

    if compiled := coverage(backend.model):  # --compile-decoder-layers: did the layers run it?
        say(f"{name}: {compiled}")
        extras["compiled_layers"] = compiled
    extras["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if args.profile:
        next_rollout = functools.partial(backend.train, args.warmup + args.iters, shard)
        extras["profile"] = bench.profile_rollout(next_rollout)
        del next_rollout  # it holds the backend: the next variant needs its memory back
    backend.close()
    del backend
    gc.collect()
    torch.cuda.empty_cache()
    return times, extras


def say(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"bench_megatron_train: {message}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="megatron,fsdp")
    parser.add_argument("--tp", type=int, default=1, help="megatron tensor-parallel size")
    parser.add_argument(
        "--attn-implementation",
        choices=("varlen", "sdpa"),
        default=None,
        help="attention of packed rows, for both backends (unset: each backend's default)",
    )
    bench.add_timing_flags(parser)
    parser.add_argument(
        "--variant",
        action="append",
        default=None,
        metavar="FLAGS",
        help="extra backend flags of one run per backend (repeatable; default: one run, none)",
    )
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
    variants = args.variant or [""]
    for name in args.backends.split(","):
        dp = world // args.tp if name == "megatron" else world
        rollout = bench.make_rollout(args.tokens_per_gpu, dp, args.steps, seed=1)
        from miles_core.partition import partition_for_dp

        dp_rank = rank // args.tp if name == "megatron" else rank
        shard = partition_for_dp(rollout, dp, keep_groups=True)[dp_rank]
        for variant in variants:
            extra = shlex.split(variant)
            key = f"{name} {variant}".strip()
            torch.cuda.reset_peak_memory_stats()
            times, measured = run(name, hf_dir, shard, args, world, extra)
            tokens = rollout.total_tokens / world  # per GPU
            seconds = statistics.median(times)
            mean_len = rollout.total_tokens / len(rollout)
            flops = tokens * bench.flops_per_token(cfg, mean_len)
            results[key] = {
                "backend": name,
                "extra_flags": variant,
                "tokens_per_s_per_gpu": tokens / seconds,
                "mfu": flops / seconds / (args.peak_tflops * 1e12),
                "seconds_per_rollout": seconds,
                "seconds_all": times,
                **measured,
            }
            r = results[key]
            say(f"{key or name}: {r['tokens_per_s_per_gpu']:.0f} tok/s/GPU, MFU {r['mfu']:.1%}, "
                f"peak {r['peak_memory_gib']:.1f} GiB, rollouts {times}")  # fmt: skip
            write_report(args, world, size, peak, results, rank)
    if rank == 0:
        print(
            f"{'backend and flags':44s} {'tok/s/GPU':>10s} {'MFU':>6s} {'peak GiB':>9s} "
            f"attention  (world {world})"
        )
        for name, r in results.items():
            print(
                f"{name:44s} {r['tokens_per_s_per_gpu']:10.0f} {r['mfu']:6.1%} "
                f"{r['peak_memory_gib']:9.1f} {r['attn_implementation']} "
                f"({r['attention_kernels']})"
            )
        for name, r in results.items():
            if "profile" in r:
                bench.print_profile(name, r["profile"])
    dist.destroy_process_group()


def write_report(args, world: int, size: str, peak: float, results: dict, rank: int) -> None:
    """The JSON report so far (written after every run, so a run cut short keeps the rest)."""
    if rank != 0:
        return
    report = {
        "world": world,
        "tp": args.tp,
        "size": size,
        "bf16_peak_tflops_measured": peak,
        "tokens_per_gpu": args.tokens_per_gpu,
        "steps": args.steps,
        **results,
    }
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
