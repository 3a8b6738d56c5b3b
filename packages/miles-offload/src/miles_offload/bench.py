"""``miles-offload-bench``: sleep/wake bandwidth against its ceilings and the naive baseline.

In one run, on one device (CUDA when present, else the CPU, where the "device" is host
memory and every copy is a memcpy):

- ceilings: one large copy each way between a pinned arena and device memory, and the raw
  O_DIRECT write/read bandwidth of ``--disk-dir`` (FileStreamer on a pinned buffer);
- ours: sleep and wake of ``--size-gb`` of model + AdamW state whose tensor sizes follow a
  decoder-only transformer (embedding, attention and MLP matrices, norms), from the 2nd
  cycle on (the 1st cycle, which pays for pinning the arena, is reported apart); the same
  to disk; the re-sleep of a frozen model;
- naive: ``.cpu()`` then ``.to(device)`` per tensor, into pageable memory.

Prints a table (GB/s, ratio to the ceiling) and writes JSON (``--json``). GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
from miles_native import CopyEngine, PinnedArena, build_info, open_file_streamer
from torch import nn

from miles_offload.device_mover import DeviceMover
from miles_offload.offload_target import OffloadTarget


@dataclass
class Row:
    name: str
    gigabytes: float
    seconds: float
    ceiling: str = ""
    ratio: float | None = None

    @property
    def gbps(self) -> float:
        return self.gigabytes / self.seconds if self.seconds > 0 else math.inf


def transformer_shapes(total_bytes: int) -> list[tuple[int, ...]]:
    """Parameter shapes of a decoder-only transformer (vocab 32000, GQA 4:1, MLP 3.5x) whose
    parameters plus two fp32 Adam moments fill about ``total_bytes`` (12 bytes a parameter).
    The hidden size is the largest of 4096..256 whose embedding stays under 1/8 of it."""
    budget, vocab = max(total_bytes // 12, 1), 32000
    hidden = next((h for h in (4096, 2048, 1024, 512) if vocab * h * 8 <= budget), 256)
    inter, kv = hidden * 7 // 2, hidden // 4
    layer = [
        (hidden, hidden),
        (kv, hidden),
        (kv, hidden),
        (hidden, hidden),
        (inter, hidden),
        (inter, hidden),
        (hidden, inter),
        (hidden,),
        (hidden,),
    ]
    per_layer = sum(math.prod(s) for s in layer)
    layers = max(1, (budget - vocab * hidden) // per_layer)
    return [(vocab, hidden)] + layer * layers + [(hidden,)]


def build_state(shapes, device) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.ParameterList(
        [nn.Parameter(torch.empty(s, device=device).fill_(0.5)) for s in shapes]
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        opt.state[p] = {
            "step": torch.tensor(1.0),
            "exp_avg": torch.full_like(p, 0.25),
            "exp_avg_sq": torch.full_like(p, 0.125),
        }
    return model, opt


def state_tensors(model, opt) -> list[torch.Tensor]:
    """What a sleep moves: the parameters and the optimizer's state (not its step counts)."""
    return list(model.parameters()) + [
        v for st in opt.state.values() for k, v in st.items() if k != "step"
    ]


def state_bytes(model, opt) -> int:
    return sum(t.numel() * t.element_size() for t in state_tensors(model, opt))


def against(name: str, gigabytes: float, seconds: float, ceiling: Row) -> Row:
    """``gigabytes`` in ``seconds``, with its bandwidth as a fraction of ``ceiling``'s."""
    return Row(name, gigabytes, seconds, ceiling.name, gigabytes / seconds / ceiling.gbps)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_ceilings(nbytes: int, device: torch.device, engine: CopyEngine) -> tuple[Row, Row]:
    arena = PinnedArena(nbytes)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rows = []
    for name, to_device in (("ceiling: pinned D2H", False), ("ceiling: pinned H2D", True)):
        dst, src = (dev.data_ptr(), arena.ptr) if to_device else (arena.ptr, dev.data_ptr())
        engine.submit([dst], [src], [nbytes], to_device=to_device).wait()  # warm-up
        best = math.inf
        for _ in range(3):
            t = time.perf_counter()
            engine.submit([dst], [src], [nbytes], to_device=to_device).wait()
            best = min(best, time.perf_counter() - t)
        rows.append(Row(name, nbytes / 1e9, best))
    return rows[0], rows[1]


def disk_ceilings(nbytes: int, disk_dir: str, chunk_bytes: int) -> tuple[Row, Row, bool]:
    arena = PinnedArena(nbytes)
    torch.frombuffer(arena, dtype=torch.uint8).fill_(7)
    path = os.path.join(disk_dir, f"miles-offload-bench-{os.getpid()}.bin")
    s = open_file_streamer(path, chunk_bytes, ring_chunks=1, io_threads=4)
    try:
        size = arena.nbytes // 4096 * 4096
        s.write(arena.ptr, size, 0)  # allocate the blocks once, as the mover's files are
        t = time.perf_counter()
        s.write(arena.ptr, size, 0)
        w = time.perf_counter() - t
        t = time.perf_counter()
        s.read(arena.ptr, size, 0)
        r = time.perf_counter() - t
        return (
            Row("ceiling: raw write", size / 1e9, w),
            Row("ceiling: raw read", size / 1e9, r),
            s.direct,
        )
    finally:
        s.close(remove=True)


def h2d_diagnostics(
    model, opt, device, engine: CopyEngine, nbytes: int, ceiling: Row
) -> tuple[Row, Row]:
    """Two host-to-device copies that bracket wake's copy path (best of 3 each):

    * the state's own tensors, one copy each from a pinned arena into device memory that is
      already allocated (per-tensor overhead, no allocation);
    * one copy of ``nbytes`` into memory allocated right before it, after the allocator
      returned its cache (what a wake copies into).
    """
    sizes = [t.numel() * t.element_size() for t in state_tensors(model, opt)]
    arena = PinnedArena(sum(sizes))
    dst = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
    src, off = [], 0
    for n in sizes:
        src.append(arena.ptr + off)
        off += n
    ptrs = [d.data_ptr() for d in dst]
    best = math.inf
    for _ in range(4):  # the first is a warm-up
        t = time.perf_counter()
        engine.submit(ptrs, src, sizes, to_device=True).wait()
        best = min(best, time.perf_counter() - t)
    per_tensor = against("diagnostic: H2D per tensor, allocated", sum(sizes) / 1e9, best, ceiling)
    del dst
    fresh_best = math.inf
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.empty_cache()
        t = time.perf_counter()
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        engine.submit([dev.data_ptr()], [arena.ptr], [nbytes], to_device=True).wait()
        fresh_best = min(fresh_best, time.perf_counter() - t)
        del dev
    fresh = against("diagnostic: H2D into fresh memory", nbytes / 1e9, fresh_best, ceiling)
    return per_tensor, fresh


def time_mover(model, opt, device, target, cycles, frozen=False):
    name = "model"
    mover = DeviceMover(
        {name: model}, [] if frozen else [opt], target, frozen={name} if frozen else ()
    )
    records = []
    for _ in range(cycles):
        _sync(device)
        s = mover.sleep()
        w = mover.wake_up()
        records.append((s, w))
    host = mover.host_bytes
    mover.close()
    return records, host


def _mean_phase(stats: list, name: str) -> float:
    return sum(st.phases.get(name, 0.0) for st in stats) / len(stats)


def _mean_phases(stats: list) -> dict[str, float]:
    names = sorted({n for st in stats for n in st.phases})
    return {n: _mean_phase(stats, n) for n in names}


def naive(model, opt, device) -> tuple[float, float]:
    tensors = state_tensors(model, opt)
    _sync(device)
    t = time.perf_counter()
    host = [x.detach().to("cpu", copy=True) for x in tensors]
    _sync(device)
    sleep = time.perf_counter() - t
    t = time.perf_counter()
    back = [h.to(device, copy=True) for h in host]
    _sync(device)
    wake = time.perf_counter() - t
    del host, back
    return sleep, wake


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    size_gb = args.size_gb if args.size_gb is not None else (8.0 if device.type == "cuda" else 0.5)
    total = int(size_gb * 1e9)
    engine = CopyEngine(device=device.index or 0, cpu_threads=args.cpu_threads)
    disk_dir = args.disk_dir or tempfile.gettempdir()
    os.makedirs(disk_dir, exist_ok=True)
    chunk_bytes = args.chunk_mb << 20

    model, opt = build_state(transformer_shapes(total), device)
    gb = state_bytes(model, opt) / 1e9
    d2h, h2d = copy_ceilings(min(total, 2 << 30), device, engine)
    rows = [d2h, h2d]

    records, arena_bytes = time_mover(model, opt, device, OffloadTarget("cpu"), args.cycles)
    first_s, first_w = records[0]
    steady = records[1:] or records
    sleeps, wakes = [s for s, _ in steady], [w for _, w in steady]
    sleep_s = sum(s.seconds for s in sleeps) / len(sleeps)
    wake_s = sum(w.seconds for w in wakes) / len(wakes)

    rows += [
        against("ours: sleep (cycle >= 2)", gb, sleep_s, d2h),
        against("ours: wake (cycle >= 2)", gb, wake_s, h2d),
        against("ours: sleep, copy phase only", gb, _mean_phase(sleeps, "copy"), d2h),
        against("ours: wake, copy phase only", gb, _mean_phase(wakes, "copy"), h2d),
        Row("ours: 1st sleep (pins arena)", gb, first_s.seconds),
        Row("ours: 1st wake", gb, first_w.seconds),
    ]
    rows += h2d_diagnostics(model, opt, device, engine, min(total, 2 << 30), h2d)
    fr, _ = time_mover(model, opt, device, OffloadTarget("cpu"), 2, frozen=True)
    model_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    rows.append(Row("ours: frozen re-sleep", model_gb, fr[1][0].seconds))

    disk_info = {}
    if not args.skip_disk:
        w_ceiling, r_ceiling, direct = disk_ceilings(min(total, 1 << 30), disk_dir, chunk_bytes)
        target = OffloadTarget("disk", disk_dir=disk_dir, chunk_mb=args.chunk_mb)
        drec, ring = time_mover(model, opt, device, target, max(2, min(args.cycles, 3)))
        ds = sum(s.seconds for s, _ in drec[1:]) / len(drec[1:])
        dw = sum(w.seconds for _, w in drec[1:]) / len(drec[1:])
        rows += [
            w_ceiling,
            r_ceiling,
            against("ours: sleep to disk", gb, ds, w_ceiling),
            against("ours: wake from disk", gb, dw, r_ceiling),
        ]
        disk_info = {"dir": disk_dir, "o_direct": direct, "host_ring_bytes": ring}

    ns, nw = naive(model, opt, device)
    rows += [Row("naive: .cpu() per tensor", gb, ns), Row("naive: .to(device) per tensor", gb, nw)]
    result = {
        "device": str(device),
        "build": build_info(),
        "copy_engine_uses_cuda": engine.uses_cuda,
        "state_gb": gb,
        "tensors": 3 * len(list(model.parameters())),
        "arena_bytes": arena_bytes,
        "disk": disk_info,
        "speedup_vs_naive": {"sleep": ns / sleep_s, "wake": nw / wake_s},
        "phases_seconds": {
            "sleep": _mean_phases(sleeps),
            "wake": _mean_phases(wakes),
        },
        "frozen_resleep_ms_per_gb": fr[1][0].seconds * 1e3 / model_gb,
        "rows": [asdict(r) | {"gbps": r.gbps} for r in rows],
    }
    return result


def format_table(result: dict) -> str:
    lines = [
        f"device {result['device']} ({result['build']}), state {result['state_gb']:.2f} GB in "
        f"{result['tensors']} tensors",
        f"{'measurement':34} {'GB':>7} {'s':>9} {'GB/s':>8}  ratio to ceiling",
    ]
    for r in result["rows"]:
        ratio = (
            f"{r['ratio']:.0%} of {r['ceiling'].split(': ')[1]}" if r["ratio"] is not None else ""
        )
        lines.append(
            f"{r['name']:34} {r['gigabytes']:7.2f} {r['seconds']:9.4f} {r['gbps']:8.2f}  {ratio}"
        )
    sp = result["speedup_vs_naive"]
    lines.append(f"speed-up over naive: sleep {sp['sleep']:.1f}x, wake {sp['wake']:.1f}x")
    lines.append(f"frozen re-sleep: {result['frozen_resleep_ms_per_gb']:.2f} ms per GB")
    for call, phases in result["phases_seconds"].items():
        spent = ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in phases.items())
        lines.append(f"{call} phases (cycle >= 2): {spent}")
    if result["disk"]:
        d = result["disk"]
        lines.append(
            f"disk: {d['dir']} (O_DIRECT {'on' if d['o_direct'] else 'refused: buffered'}), "
            f"host ring {d['host_ring_bytes'] / 2**20:.0f} MiB"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="miles-offload-bench", description=__doc__.split("\n")[0])
    p.add_argument(
        "--size-gb", type=float, default=None, help="State size (default 8 on CUDA, 0.5 on CPU)."
    )
    p.add_argument(
        "--device", default=None, help="cuda, cuda:N or cpu (default: cuda when present)."
    )
    p.add_argument(
        "--cycles", type=int, default=3, help="Sleep/wake cycles (the 1st reported apart)."
    )
    p.add_argument(
        "--disk-dir", default=None, help="Directory for the disk target (default: temp dir)."
    )
    p.add_argument("--chunk-mb", type=int, default=256, help="Disk staging chunk size.")
    p.add_argument("--cpu-threads", type=int, default=2, help="memcpy threads in CPU mode.")
    p.add_argument("--skip-disk", action="store_true", help="Leave out the disk measurements.")
    p.add_argument("--json", default=None, metavar="PATH", help="Also write the results here.")
    args = p.parse_args(argv)
    if args.cycles < 2:
        p.error("--cycles must be >= 2 (the first cycle is reported apart)")
    result = run(args)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
