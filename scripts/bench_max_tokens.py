"""Benchmark: the largest ``--max-tokens-per-gpu`` one GPU trains at a model shape, with the
fused log-prob head (``--fused-log-probs``, the default) and with the dense one.

    torchrun --nproc-per-node 1 scripts/bench_max_tokens.py --size 4B --gradient-checkpointing \\
        --out max_tokens.json

Per head, one ``FSDPBackend`` (bf16 compute, fp32 master weights and AdamW state on the GPU)
trains rollouts of one micro-batch each (a budget larger than any rollout, one optimizer step)
of about N tokens, N climbing ``--ladder`` until the first CUDA out-of-memory; the largest N that
trained is the largest ``--max-tokens-per-gpu`` that fits (a micro-batch never holds more than
that budget), the first that did not bounds it from above. Each rung reports its seconds and
peak memory. Prints a table and writes JSON (after every rung, so a run cut short keeps what it
measured); it asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import train_bench_model as bench  # noqa: E402  (same-directory module)

LADDER = [16384, 24576, 32768, 49152, 65536, 98304, 131072, 196608, 262144, 393216]


def say(message: str) -> None:
    print(f"bench_max_tokens: {message}", flush=True)


def probe(hf_dir: str, head: str, args, report: dict, write) -> None:
    """Climb the ladder with one backend using ``head`` until a rung runs out of memory or
    ``--deadline`` passes; rung results go into ``report[head]``."""
    from miles_core.partition import partition_for_dp

    rungs = report[head] = {"rungs": [], "largest_fit": None, "first_oom": None}
    t0 = time.perf_counter()
    backend = bench.fsdp_backend(
        hf_dir,
        10 * max(args.ladder),  # one micro-batch per rollout, whatever its size
        1,
        args.gradient_checkpointing,
        ["--fused-log-probs" if head == "fused" else "--no-fused-log-probs", *args.backend_flags],
    )
    rungs["state_gb"] = torch.cuda.memory_allocated() / 2**30
    say(
        f"{head} head: backend ready in {time.perf_counter() - t0:.1f} s, "
        f"{rungs['state_gb']:.1f} GiB held before the first rollout"
    )
    for i, target in enumerate(args.ladder):
        if time.perf_counter() - args.start > args.deadline:
            say(f"{head} head: deadline passed, {target} tokens and above not tried")
            break
        rollout = partition_for_dp(bench.make_rollout(target, 1, 1, seed=i), 1)[0]
        tokens = rollout.total_tokens
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        try:
            backend.train(i, rollout)
            torch.cuda.synchronize()
            fit = True
        except RuntimeError as error:  # torch.OutOfMemoryError, or a wrapper naming it
            if "out of memory" not in str(error).lower():
                raise
            fit = False
        rung = {
            "tokens": tokens,
            "fit": fit,
            "seconds": time.perf_counter() - t1,
            "peak_gb": torch.cuda.max_memory_allocated() / 2**30,
        }
        rungs["rungs"].append(rung)
        if fit:
            rungs["largest_fit"] = tokens
        else:
            rungs["first_oom"] = tokens
        say(
            f"{head} head: {tokens} tokens {'trained' if fit else 'OUT OF MEMORY'} in "
            f"{rung['seconds']:.1f} s, peak {rung['peak_gb']:.1f} GiB"
        )
        write()
        if not fit:
            break
    del backend  # an OOM leaves the backend mid-step: drop it rather than reuse it
    gc.collect()
    torch.cuda.empty_cache()
    rungs["held_after_gb"] = torch.cuda.memory_allocated() / 2**30
    say(f"{head} head: {rungs['held_after_gb']:.2f} GiB still allocated after dropping it")
    write()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="4B", choices=sorted(bench.QWEN3_SIZES))
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument(
        "--heads", nargs="+", default=["dense", "fused"], choices=["dense", "fused"]
    )
    parser.add_argument("--ladder", type=int, nargs="+", default=LADDER, help="tokens per rung")
    parser.add_argument(
        "--deadline", type=float, default=1e9, help="seconds after which no new rung starts"
    )
    parser.add_argument(
        "--backend-flags",
        default="",
        help="more miles flags for the backend, e.g. --compile-decoder-layers (each head and "
        "rung runs with them; the first rung then includes the compilation)",
    )
    parser.add_argument("--out", default="bench_max_tokens.json")
    args = parser.parse_args()
    args.backend_flags = args.backend_flags.split()
    args.start = time.perf_counter()

    bench.init_nccl()
    if dist.get_world_size() != 1:
        raise SystemExit("bench_max_tokens: run it on one GPU (--nproc-per-node 1)")
    cfg = bench.qwen3_config(args.size)
    say(f"writing a random Qwen3-{args.size}-shaped model")
    hf_dir = bench.shared_model_dir(cfg, prefix="bench_max_tokens_")
    report = {
        "device": torch.cuda.get_device_name(),
        "gpu_memory_gb": torch.cuda.get_device_properties(0).total_memory / 2**30,
        "size": args.size,
        "gradient_checkpointing": args.gradient_checkpointing,
        "torch": torch.__version__,
        "backend_flags": args.backend_flags,
    }

    def write() -> None:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)

    for head in args.heads:
        probe(hf_dir, head, args, report, write)

    print(
        f"\n{report['device']} ({report['gpu_memory_gb']:.0f} GiB), Qwen3-{args.size} shape, "
        f"gradient checkpointing {args.gradient_checkpointing}, one micro-batch per rollout"
        + (f", {' '.join(args.backend_flags)}" if args.backend_flags else "")
    )
    print(f"{'head':6s} {'tokens':>8s} {'result':>8s} {'seconds':>8s} {'peak GiB':>9s}")
    for head in args.heads:
        for r in report[head]["rungs"]:
            result = "fits" if r["fit"] else "OOM"
            print(
                f"{head:6s} {r['tokens']:8d} {result:>8s} {r['seconds']:8.1f} {r['peak_gb']:9.1f}"
            )
    for head in args.heads:
        h = report[head]
        print(
            f"{head}: largest that trained {h['largest_fit']}, first out of memory {h['first_oom']}"
        )
    write()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
