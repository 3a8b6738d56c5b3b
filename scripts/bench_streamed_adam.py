"""Benchmark of the streamed AdamW (miles_offload.streamed_adam) against its I/O floor.

For each ``--params-b`` (billions of parameters of optimizer state per run, split over the
ranks of ``torchrun``) and each ``--moment-dtype``, on one device per rank:

- streamed: the mean time of ``optimizer.step()`` over ``--steps`` steps after the first
  (which only initialises and writes the bucket files), with the bytes read and written;
- I/O floor: read bytes / raw O_DIRECT read bandwidth + written bytes / raw write bandwidth,
  both measured in the same run on ``--disk-dir`` (all ranks at once, as they share the disk);
- GPU-resident: ``torch.optim.AdamW(fused=True)`` on the same parameters (state on the device),
  unless ``--skip-resident``;
- the peak device memory the step adds, in buckets (at most 3 expected).

Prints a table and writes JSON (``--json``). Target: step <= 1.2x the I/O floor. GB = 1e9 B.

    python scripts/bench_streamed_adam.py --params-b 1 2 --disk-dir /nvme/bench --json out.json
    torchrun --nproc-per-node 2 scripts/bench_streamed_adam.py --params-b 4 --disk-dir /nvme/b
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
from miles_native import build_info
from miles_offload.bench import disk_ceilings
from miles_offload.streamed_adam import StreamedAdamConfig, StreamedAdamW
from torch import nn

TENSOR_NUMEL = 100_000_000  # parameters are made of tensors of this size (the last smaller)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def make_params(numel: int, device: torch.device) -> list[tuple[str, nn.Parameter]]:
    params, left, i = [], numel, 0
    while left > 0:
        n = min(left, TENSOR_NUMEL)
        p = nn.Parameter(torch.randn(n, device=device) * 0.02)
        p.grad = torch.randn(n, device=device) * 1e-3
        params.append((f"w{i}", p))
        left -= n
        i += 1
    return params


def time_streamed(params, device, args, moment_dtype: str) -> dict:
    config = StreamedAdamConfig(
        disk_dir=args.disk_dir,
        moment_dtype=moment_dtype,
        bucket_numel=args.bucket_numel,
        min_numel=0,
        chunk_mb=args.chunk_mb,
        ring_chunks=args.ring_chunks,
        io_threads=args.io_threads,
        fused=device.type == "cuda",
        foreach=None if device.type == "cuda" else True,
    )
    opt = StreamedAdamW(params, lr=1e-5, weight_decay=0.01, config=config)
    try:
        file_bytes = sum(b.nbytes for b in opt.buckets)
        _barrier()
        t = time.perf_counter()
        opt.step()  # initialises the masters from the parameters; writes only
        _sync(device)
        first = time.perf_counter() - t
        times, extra = [], 0
        for _ in range(args.steps):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            _barrier()
            t = time.perf_counter()
            opt.step()
            _sync(device)
            times.append(time.perf_counter() - t)
            if device.type == "cuda":
                extra = max(extra, torch.cuda.max_memory_allocated(device) - base)
        slot = max(b.nbytes for b in opt.buckets)
        return {
            "moment_dtype": moment_dtype,
            "buckets": len(opt.buckets),
            "bucket_bytes": slot,
            "read_bytes": file_bytes,
            "written_bytes": file_bytes,
            "first_step_s": first,
            "step_s": sum(times) / len(times),
            "steps_s": times,
            "peak_extra_device_bytes": extra,
            "peak_buckets_resident": extra / slot if slot else 0.0,
            "pinned_ring_bytes": opt.pinned_bytes,
            "o_direct": opt.direct_io,
        }
    finally:
        opt.close()


def time_resident(params, device, steps: int) -> float:
    opt = torch.optim.AdamW(
        [p for _, p in params], lr=1e-5, weight_decay=0.01, fused=device.type == "cuda"
    )
    opt.step()
    _sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        opt.step()
    _sync(device)
    seconds = (time.perf_counter() - t) / steps
    opt.state.clear()
    return seconds


def run(args: argparse.Namespace) -> dict:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if args.device:
        device = torch.device(args.device)
    elif torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    args.disk_dir = os.path.join(args.disk_dir or tempfile.gettempdir(), f"rank{rank}")
    os.makedirs(args.disk_dir, exist_ok=True)
    _barrier()
    write, read, direct = disk_ceilings(
        int(args.ceiling_gb * 1e9), args.disk_dir, args.chunk_mb << 20
    )
    write_bw, read_bw = write.gbps * 1e9, read.gbps * 1e9
    runs = []
    for params_b in args.params_b:
        numel = int(params_b * 1e9) // world
        params = make_params(numel, device)
        resident = None if args.skip_resident else time_resident(params, device, args.steps)
        for moment_dtype in args.moment_dtype:
            r = time_streamed(params, device, args, moment_dtype)
            floor = r["read_bytes"] / read_bw + r["written_bytes"] / write_bw
            r.update(
                params_b=params_b,
                params_per_rank=numel,
                io_floor_s=floor,
                ratio_to_floor=r["step_s"] / floor,
                resident_step_s=resident,
            )
            runs.append(r)
        del params
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result = {
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "build": build_info(),
        "world_size": world,
        "rank": rank,
        "disk": {
            "dir": args.disk_dir,
            "o_direct": direct,
            "raw_write_gbps": write.gbps,
            "raw_read_gbps": read.gbps,
            "ceiling_gb": write.gigabytes,
        },
        "bucket_numel": args.bucket_numel,
        "chunk_mb": args.chunk_mb,
        "ring_chunks": args.ring_chunks,
        "runs": runs,
    }
    return result


def format_table(results: list[dict]) -> str:
    head = results[0]
    lines = [
        f"{head['device']} x{head['world_size']} ({head['build']}); per-rank raw O_DIRECT "
        + ", ".join(
            f"r{r['rank']} write {r['disk']['raw_write_gbps']:.2f} / read "
            f"{r['disk']['raw_read_gbps']:.2f} GB/s"
            for r in results
        ),
        f"{'params':>7} {'moments':>7} {'rank':>4} {'buckets':>7} {'GB r+w':>8} {'step s':>8} "
        f"{'floor s':>8} {'x floor':>7} {'GPU AdamW s':>11} {'peak bkts':>9}",
    ]
    for res in results:
        for r in res["runs"]:
            resident = f"{r['resident_step_s']:.4f}" if r["resident_step_s"] is not None else "-"
            lines.append(
                f"{r['params_b']:>6}B {r['moment_dtype']:>7} {res['rank']:>4} {r['buckets']:>7} "
                f"{(r['read_bytes'] + r['written_bytes']) / 1e9:8.2f} {r['step_s']:8.3f} "
                f"{r['io_floor_s']:8.3f} {r['ratio_to_floor']:7.2f} {resident:>11} "
                f"{r['peak_buckets_resident']:9.2f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params-b", type=float, nargs="+", default=[1.0, 2.0])
    p.add_argument("--moment-dtype", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--bucket-numel", type=int, default=200_000_000)
    p.add_argument("--steps", type=int, default=3, help="Timed steps after the first.")
    p.add_argument("--disk-dir", default=None, help="Where the bucket files go (default: temp).")
    p.add_argument("--chunk-mb", type=int, default=16, help="Staging chunk of each bucket file.")
    p.add_argument("--ring-chunks", type=int, default=4)
    p.add_argument("--io-threads", type=int, default=4)
    p.add_argument("--ceiling-gb", type=float, default=4.0, help="Size of the raw I/O test.")
    p.add_argument("--device", default=None, help="cuda:N or cpu (default: cuda when present).")
    p.add_argument("--skip-resident", action="store_true", help="No GPU-resident AdamW run.")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        result = run(args)
        results = [result]
        if dist.is_initialized():
            results = [None] * dist.get_world_size()
            dist.all_gather_object(results, result)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(format_table(results))
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
