"""Benchmark: the attention's host memory per rank at context-parallel sizes 1, 2, ... for one
long packed sequence (CPU, gloo).

    python scripts/bench_cp_attention.py --tokens 4096 --heads 8 --cp 1 2 --out bench_cp.json

Each CP size runs in fresh processes (one per CP rank, gloo on loopback). A rank holds its
zig-zag shard of one THD-packed row of ``--tokens`` tokens (one sample;
``miles_megatron.context_parallel``) and runs the megatron backend's attention function
(``miles_megatron.sdpa_attention.sdpa_attend``: K/V all-gathered over the CP group, SDPA with the
shard's block-causal mask) forward and backward in fp32. Reported per rank: the peak resident
memory during that step above the resident memory before it (``ru_maxrss``, the process's
high-water mark: on the host, glibc serves and returns these large blocks with mmap, so the
mark follows the live peak), wall time, and for reference the size dense scores would have,
``heads x (T / cp) x T x 4`` bytes (the fused kernels store none: their ``T / cp x T`` term is
the mask, boolean and SDPA's additive fp32 copy). CP = 1 is the baseline of the same run. Prints
a table and writes JSON; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from miles_core.ports import free_port


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rank(rank: int, cp: int, port: int, args: argparse.Namespace, queue) -> None:
    from miles_core.batch import RolloutBatch, Sample
    from miles_core.packing import pack_thd
    from miles_megatron.context_parallel import PackedShard, pad_multiple
    from miles_megatron.sdpa_attention import sdpa_attend

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp)
    group = dist.new_group(list(range(cp))) if cp > 1 else None
    tokens = torch.randint(0, 1000, (args.tokens,), generator=torch.Generator().manual_seed(0))
    sample = Sample(tokens=tokens, response_length=args.tokens // 2, reward=0.0)
    packed = pack_thd(RolloutBatch([sample]), pad_multiple=pad_multiple(cp, 1))
    shard = PackedShard.of(packed, cp, rank, group)
    mask = shard.attention_mask()
    local = shard.num_tokens
    gen = torch.Generator().manual_seed(1 + rank)
    shape_q = (local, 1, args.heads, args.head_dim)
    shape_kv = (local, 1, args.kv_heads, args.head_dim)
    q = torch.randn(shape_q, generator=gen).requires_grad_()
    k = torch.randn(shape_kv, generator=gen).requires_grad_()
    v = torch.randn(shape_kv, generator=gen).requires_grad_()
    grad_out = torch.randn(shape_q, generator=gen)
    scale = args.head_dim**-0.5
    if group is not None:
        dist.barrier(group)
    before, prior_peak = _rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    out = sdpa_attend(q, k, v, mask, scale, cp_group=group)
    out.backward(grad_out)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    queue.put(
        {
            "cp": cp,
            "rank": rank,
            "local_tokens": local,
            "peak_above_start_mib": (peak - before) / 2**20,
            "prior_peak_above_start_mib": max(prior_peak - before, 0) / 2**20,
            "scores_mib": args.heads * local * packed.num_tokens * 4 / 2**20,
            "mask_mib": mask.numel() / 2**20,
            "seconds": seconds,
        }
    )
    dist.destroy_process_group()


def measure(cp: int, args: argparse.Namespace) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, cp, port, args, queue)) for r in range(cp)]
    for p in procs:
        p.start()
    rows = [queue.get(timeout=args.timeout) for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"CP={cp}: a rank exited with {p.exitcode}")
    return sorted(rows, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default="bench_cp_attention.json")
    args = parser.parse_args()
    args.kv_heads = args.kv_heads or args.heads
    rows = [row for cp in args.cp for row in measure(cp, args)]
    base = max(r["peak_above_start_mib"] for r in rows if r["cp"] == args.cp[0])
    print(f"one packed sequence of {args.tokens} tokens, {args.heads} heads x {args.head_dim}")
    print("| CP | rank | tokens | peak above start (MiB) | vs first CP | dense scores (MiB) | s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['cp']} | {r['rank']} | {r['local_tokens']} | {r['peak_above_start_mib']:.0f} "
            f"| {r['peak_above_start_mib'] / base:.2f} | {r['scores_mib']:.0f} "
            f"| {r['seconds']:.2f} |"
        )
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
