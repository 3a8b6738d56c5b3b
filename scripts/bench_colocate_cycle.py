"""Benchmark of one colocated rollout cycle's trainer side: sleep, publish asleep, wake.

One FSDP trainer (a Qwen3-shaped model of ``--hidden``/``--layers``, fp32 masters, AdamW state
after one step) under ``--offload-train-target cpu`` and ``disk``:

- sleep and wake: seconds and bytes (model + optimizer state), against the floor of the same
  bytes: one contiguous device -> host copy (and back) of a buffer as large, measured in the
  same run (``disk``: plus the raw write/read of a file that large in ``--disk-dir``);
- publish asleep: the weight source read from the host copies or file and packed bucket by
  bucket into two ``--update-weight-buffer-size`` slots as an ``ipc`` publish packs them (its
  deferred tensors filled straight into the slot), against publishing the same bytes from the
  awake trainer;
- the trainer's peak device memory during the asleep publish against the bucket size (CUDA:
  ``max_memory_allocated`` above what the sleeping trainer holds; CPU: the slots' bytes).
  Target on a GPU: <= 3 x the buffer size plus one bucket's gather.

The whole cycle (sleep + publish asleep + wake) is set against its floor: the pinned copies of
the bytes that must move (the state to the host and back, the published bytes to the device).
Target on a GPU: <= 1.2x.

Prints a table and writes JSON (``--json``). GB = 1e9 B.

    python scripts/bench_colocate_cycle.py --hidden 1024 --layers 8 --json out.json
    python scripts/bench_colocate_cycle.py --size 1.7B --buffer-mb 512 --targets cpu  # a GPU node
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def make_checkpoint(path: str, hidden: int, layers: int, vocab: int, size: str | None) -> None:
    if size is not None:  # a published Qwen3 shape, random bf16 weights
        import train_bench_model

        train_bench_model.write_random_model(path, train_bench_model.qwen3_config(size))
        return
    from miles_launch.tiny_model import save_char_tokenizer, tiny_qwen3

    model = tiny_qwen3(
        0,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        head_dim=hidden // 4,
        num_hidden_layers=layers,
    )
    model.to(torch.bfloat16).save_pretrained(path)
    save_char_tokenizer(path, vocab_size=vocab)


def build(ckpt: str, target: str, disk_dir: str, buffer: int):
    from miles_core.args import core_groups, parse_args
    from miles_core.batch import RolloutBatch, Sample
    from miles_fsdp.args import fsdp_groups
    from miles_fsdp.backend import FSDPBackend

    argv = ["--hf-checkpoint", ckpt, "--lr", "1e-4", "--advantage-estimator", "grpo"]
    argv += ["--offload-train", "--offload-train-target", target]
    argv += ["--update-weight-buffer-size", str(buffer), "--attn-implementation", "sdpa"]
    if target == "disk":
        argv += ["--offload-train-disk-dir", disk_dir]
    args = parse_args(argv, [*core_groups(), *fsdp_groups()])
    backend = FSDPBackend()
    backend.init(args)
    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(
            tokens=torch.randint(1, 60, (16,), generator=g),
            response_length=8,
            reward=float(i % 2),
            group_index=i // 2,
        )
        for i in range(4)
    ]
    backend.train(0, RolloutBatch(samples))  # AdamW state exists
    return backend


def publish_pass(backend, buffer: int) -> tuple[float, int, int]:
    """Pack the weight source into buckets of ``buffer`` bytes as an ``ipc`` publish does (its
    deferred tensors filled straight into two bucket slots, each bucket made final before the
    next is packed, as before its handoff); returns (seconds, bytes, the slots' bytes)."""
    from miles_sync.bucket_slots import BucketSlots
    from miles_sync.buckets import plan_buckets_marked

    device = backend.device
    slots = BucketSlots(device, buffer)
    source = backend.weight_source(buffer)
    total = 0

    def run():
        nonlocal total
        for index, (named, _) in enumerate(plan_buckets_marked(source.deferred(), buffer)):
            flat, _ = slots.pack(index, named)
            slots.synchronize(index)
            total += flat.numel()

    seconds = _timed(run, device)
    return seconds, total, slots.held_bytes


#: the floor's copies move at most this many bytes and are scaled to the state's size: a pinned
#: copy's rate is flat well below this, and a second pinned buffer as large as the trainer's
#: state would not fit the host beside its arena at the larger shapes
FLOOR_MAX_BYTES = 4 << 30


def floor_copy(nbytes: int, device: torch.device, disk_dir: str | None) -> dict[str, float]:
    """One contiguous copy of ``nbytes`` each way (and the file write/read for disk), timed on at
    most ``FLOOR_MAX_BYTES`` and scaled to ``nbytes``."""
    size = min(nbytes, FLOOR_MAX_BYTES)
    scale = nbytes / size
    src = torch.empty(size, dtype=torch.uint8, device=device)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
    src.zero_()  # first touch of both buffers' pages, outside the timing
    host.copy_(src)
    out = {
        "to_host_s": scale * _timed(lambda: host.copy_(src, non_blocking=True), device),
        "to_device_s": scale * _timed(lambda: src.copy_(host, non_blocking=True), device),
    }
    if disk_dir is not None:
        path = os.path.join(disk_dir, "floor.bin")
        data = host.numpy().tobytes()
        t = time.perf_counter()
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        out["write_s"] = scale * (time.perf_counter() - t)
        t = time.perf_counter()
        with open(path, "rb") as f:
            f.read()
        out["read_s"] = scale * (time.perf_counter() - t)
        os.remove(path)
    return out


def bench(
    target: str, ckpt: str, disk_dir: str, buffer: int, warmup_cycles: int, profile: bool
) -> dict:
    backend = build(ckpt, target, disk_dir, buffer)
    device = backend.device
    try:
        for _ in range(warmup_cycles):  # the first sleep allocates the pinned host arena
            backend.sleep()
            backend.wake_up()
        awake_s, nbytes, _ = publish_pass(backend, buffer)
        sleep_s = _timed(backend.sleep, device)
        moved = backend.mover.last.bytes_copied
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        asleep_s, _, slot_bytes = publish_pass(backend, buffer)
        peak = (
            torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else slot_bytes
        )
        prof = None
        if profile and device.type == "cuda":  # one more asleep publish, under the profiler
            import train_bench_model

            prof = train_bench_model.profile_rollout(lambda: publish_pass(backend, buffer))
            prof["sync_sites"] = train_bench_model.sync_sites(lambda: publish_pass(backend, buffer))
        wake_s = _timed(backend.wake_up, device)
        floor = floor_copy(moved, device, disk_dir if target == "disk" else None)
    finally:
        backend.close()
    sleep_floor = floor["to_host_s"] + floor.get("write_s", 0.0)
    wake_floor = floor["to_device_s"] + floor.get("read_s", 0.0)
    # the published bytes cross host -> device once, at the pinned copy's rate
    publish_floor = nbytes / moved * floor["to_device_s"] if target == "cpu" else None
    cycle = sleep_s + asleep_s + wake_s
    cycle_floor = sleep_floor + wake_floor + (publish_floor or 0.0)
    return {
        "target": target,
        "device": str(device),
        "warmup_cycles": warmup_cycles,
        "moved_bytes": moved,
        "published_bytes": nbytes,
        "buffer_bytes": buffer,
        "sleep_s": sleep_s,
        "sleep_floor_s": sleep_floor,
        "wake_s": wake_s,
        "wake_floor_s": wake_floor,
        "publish_awake_s": awake_s,
        "publish_asleep_s": asleep_s,
        "publish_floor_s": publish_floor,
        "cycle_s": cycle,
        "cycle_floor_s": cycle_floor,
        "cycle_x_floor": cycle / cycle_floor,
        "peak_publish_bytes": peak,
        "peak_over_buffer": peak / buffer,
        "asleep_publish_profile": prof,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument(
        "--size",
        default=None,
        help="a Qwen3 shape (0.6B, 1.7B, 4B, 8B) instead of --hidden/--layers",
    )
    parser.add_argument("--buffer-mb", type=float, default=4.0)
    parser.add_argument("--targets", nargs="+", default=["cpu", "disk"])
    parser.add_argument("--disk-dir", default=None)
    parser.add_argument(
        "--warmup-cycles",
        type=int,
        default=1,
        help="sleep/wake cycles before the measured one (a job's first sleep also allocates "
        "the pinned host arena; every later rollout reuses it)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="on a GPU: run one more asleep publish under torch.profiler and print where its "
        "time goes (copies, casts, host waits by call site)",
    )
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=0, world_size=1)
    buffer = int(opts.buffer_mb * (1 << 20))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        make_checkpoint(ckpt, opts.hidden, opts.layers, opts.vocab, opts.size)
        disk_dir = opts.disk_dir or os.path.join(tmp, "offload")
        os.makedirs(disk_dir, exist_ok=True)
        for target in opts.targets:
            rows.append(bench(target, ckpt, disk_dir, buffer, opts.warmup_cycles, opts.profile))
    dist.destroy_process_group()
    head = (
        "target  moved GB  sleep s (floor)   wake s (floor)    publish awake s  asleep s  "
        "peak/buffer  cycle s (x floor)"
    )
    print(head)
    for r in rows:
        print(
            f"{r['target']:<7} {r['moved_bytes'] / 1e9:8.3f}  "
            f"{r['sleep_s']:6.3f} ({r['sleep_floor_s']:6.3f})  "
            f"{r['wake_s']:6.3f} ({r['wake_floor_s']:6.3f})  "
            f"{r['publish_awake_s']:15.3f}  {r['publish_asleep_s']:8.3f}  "
            f"{r['peak_over_buffer']:11.2f}  {r['cycle_s']:.3f} ({r['cycle_x_floor']:.2f}x)"
        )
    for r in rows:
        if r["asleep_publish_profile"] is not None:
            import train_bench_model

            train_bench_model.print_profile(
                f"asleep publish, {r['target']} target", r["asleep_publish_profile"]
            )
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
