"""Benchmark trainer -> engine weight sync on GPUs: publish time per mode against its floor and
against a naive publish.

    python scripts/bench_weight_sync.py --shapes 1.7b 7b --json bench_weight_sync.json

``--modes`` picks the rows: ``ipc`` needs one GPU (the engine shares GPU 0 with the trainer,
colocated); ``broadcast`` and ``p2p`` need 2 (the engine sits on GPU 1: NCCL needs one GPU per
rank). ``--buffer-size`` takes several sizes (one row per mode and size). Each shape is a Qwen3-shaped bf16
model with random weights, written once as a HF checkpoint that the built-in engine
(``python -m miles_launch.builtin_engine --device cuda:N``) loads; the trainer's tensors live on GPU 0.

Rows (median of ``--repeats`` after one warm-up):

* ``ipc``: :class:`~miles_sync.weight_sync.WeightPublisher` in ``ipc`` mode (the whole round:
  pause, buckets through CUDA IPC, version, continue). Floor: one device-to-device copy of all
  bytes on GPU 0. Target <= 3x the floor.
* ``broadcast``: the same in ``broadcast`` mode. Floor: one NCCL broadcast of all bytes from
  GPU 0 to a process on GPU 1. Target <= 1.5x the floor.
* ``p2p`` (``--p2p-ranks N``, default 2): N trainer processes, all on GPU 0 (gloo among
  themselves), each rank 0 of its own NCCL group with the engine on GPU 1 and sending its share
  of the buckets. Floor: the broadcast floor (the senders share GPU 0's links, so this measures
  p2p's own overhead, not its fan-in).
* ``naive-ipc`` / ``naive-broadcast``: one HTTP call and one transfer per tensor. Targets:
  ``ipc`` and ``broadcast`` >= 10x faster.
* ``fixed_round_s`` (a column of every mode's row): the same publisher sending one 4 KiB tensor,
  the round's cost whatever the size (pause, HTTP calls, version, continue).

disk-delta measures the filesystem and is not run here.
Prints a table and writes JSON; asserts nothing.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from miles_core.ports import free_port

START = time.perf_counter()

SHAPES = {
    # Qwen3-1.7B, a 7B and a 14B (Qwen2.5-like) shape: hidden, layers, intermediate, heads, kv heads,
    # head dim, vocab.
    "1.7b": dict(hidden=2048, layers=28, inter=6144, heads=16, kv=8, head_dim=128, vocab=151936),
    "7b": dict(hidden=3584, layers=28, inter=18944, heads=28, kv=4, head_dim=128, vocab=152064),
    # Qwen2.5-14B-like
    "14b": dict(hidden=5120, layers=48, inter=13824, heads=40, kv=8, head_dim=128, vocab=152064),
}


def qwen3_config(shape: dict):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["inter"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv"],
        head_dim=shape["head_dim"],
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )


def write_checkpoint(shape_name: str, root: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A random bf16 Qwen3 checkpoint (config, weights, a byte-level tokenizer) and the same
    tensors on GPU 0 as the trainer's weights."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = root / shape_name
    config = qwen3_config(SHAPES[shape_name])
    with torch.device("meta"):
        from transformers import Qwen3ForCausalLM

        meta = Qwen3ForCausalLM(config)
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = {}
    for name, param in meta.state_dict().items():
        t = torch.empty(param.shape, dtype=torch.bfloat16, device="cuda")
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.normal_(0, 0.02, generator=gen)
        weights[name] = t
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    save_file({n: t.cpu() for n, t in weights.items()}, str(path / "model.safetensors"))
    vocab = {f"<b{i}>": i for i in range(256)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<b0>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<b0>").save_pretrained(path)
    return path, weights


class Engine:
    def __init__(self, model_path: Path, device: str, port: int, log_dir: Path):
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "miles_launch.builtin_engine", "--model-path", str(model_path)]
        cmd += ["--port", str(port), "--device", device, "--dtype", "bfloat16"]
        cmd += ["--log-level", "debug"]  # per-bucket decode/load times (engine_bucket_ms)
        self.log = open(log_dir / f"engine-{port}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine on {device} exited; see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1)
        raise TimeoutError(f"engine on {device} not healthy; see {self.log.name}")

    def log_offset(self) -> int:
        return Path(self.log.name).stat().st_size

    def bucket_ms(self, since: int) -> dict | None:
        """Median decode / queued / load ms per ``/update_weights_from_tensor`` the engine
        logged after byte ``since`` of its log (the engine's side of each bucket)."""
        from miles_launch.builtin_engine.weight_routes import bucket_timings

        return bucket_timings(Path(self.log.name).read_bytes()[since:].decode(errors="replace"))

    def close(self):
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_floor(nbytes: int, repeats: int) -> float:
    """One device-to-device copy of ``nbytes`` on GPU 0."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src)
    return timed(lambda: dst.copy_(src), repeats)


def _floor_receiver(_, port: int, nbytes: int, repeats: int) -> None:
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

    torch.cuda.set_device(1)
    timeout = datetime.timedelta(minutes=5)
    store = dist.PrefixStore("floor", dist.TCPStore("127.0.0.1", port, 2, False, timeout=timeout))
    pg, _ = _new_process_group_helper(
        2, 1, [], Backend("nccl"), store, group_name="floor", timeout=timeout
    )
    _world.pg_group_ranks[pg] = {0: 0, 1: 1}
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    for _ in range(repeats + 1):
        dist.broadcast(buf, src=0, group=pg)
    torch.cuda.synchronize()


def broadcast_floor(nbytes: int, repeats: int) -> float:
    """One NCCL broadcast of ``nbytes`` from GPU 0 to a process on GPU 1."""
    from miles_sync.engine_group import host_store, join_as_master

    timeout = datetime.timedelta(minutes=5)
    store = host_store("127.0.0.1", 0, 2, timeout)  # listening before the receiver is told
    ctx = mp.start_processes(
        _floor_receiver,
        args=(store.port, nbytes, repeats),
        nprocs=1,
        join=False,
        start_method="spawn",
    )
    pg = join_as_master(store, 2, "floor", "nccl", timeout)
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    seconds = timed(lambda: dist.broadcast(buf, src=0, group=pg), repeats)
    ctx.join()
    dist.destroy_process_group(pg)
    return seconds


def naive_ipc(engine_url: str, weights: dict[str, torch.Tensor]) -> None:
    """One /update_weights_from_tensor per tensor (a list of one (name, tensor), CUDA IPC)."""
    from miles_core.engine import EngineClient
    from miles_sync.buckets import dumps_sglang_wire

    with EngineClient(engine_url, timeout=600) as client, client.weight_update():
        for name, tensor in weights.items():
            entry = base64.b64encode(dumps_sglang_wire([(name, tensor)])).decode()
            client.update_weights_from_tensor([entry])


def naive_broadcast(group, weights: dict[str, torch.Tensor]) -> None:
    """One /update_weights_from_distributed and one broadcast per tensor."""
    import concurrent.futures

    engine = group.engines[0]
    with concurrent.futures.ThreadPoolExecutor(1) as pool, engine.weight_update():
        for name, tensor in weights.items():
            reply = pool.submit(
                engine.update_weights_from_distributed,
                [name],
                [tensor.dtype],
                [list(tensor.shape)],
                group_name=group.name,
            )
            group.broadcast(tensor)
            reply.result()


def _p2p_rank(rank: int, world: int, port: int, path: str, url: str, args, buffer, queue):
    """One p2p trainer rank: the checkpoint's tensors on GPU 0, its share of every publish."""
    from miles_sync.ranks import RankContext
    from miles_sync.weight_sync import SyncConfig, WeightPublisher
    from safetensors.torch import load_file

    torch.cuda.set_device(0)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    weights = load_file(str(Path(path) / "model.safetensors"), device="cuda:0")
    config = SyncConfig(mode="p2p", buffer_size=buffer, group_backend="nccl")
    publisher = WeightPublisher(config, RankContext.from_default_group())
    seconds = timed(lambda: publisher.update_weights(weights.items(), [url]), args.repeats)
    publisher.close()
    dist.barrier()
    if rank == 0:
        queue.put(seconds)
    dist.destroy_process_group()


def p2p_publish(path: Path, url: str, args, buffer: int) -> float:
    """Median p2p publish time over ``--p2p-ranks`` trainer processes (rank 0's clock)."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_p2p_rank, args=(r, args.p2p_ranks, port, str(path), url, args, buffer, queue)
        )
        for r in range(args.p2p_ranks)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + args.p2p_timeout
    for proc in procs:
        proc.join(max(1.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    codes = [proc.exitcode for proc in procs]
    if any(code != 0 for code in codes):
        raise RuntimeError(f"p2p trainer ranks ended with {codes} (timeout {args.p2p_timeout} s)")
    return queue.get()


def say(message: str) -> None:
    print(f"bench_weight_sync [{time.perf_counter() - START:.0f}s]: {message}", flush=True)


def fixed_round(publisher, url: str, repeats: int, weights: dict) -> float:
    """The round's fixed cost: the same publisher sending one small tensor (the final norm)."""
    tiny = [("model.norm.weight", weights["model.norm.weight"])]
    return timed(lambda: publisher.update_weights(iter(tiny), [url]), repeats)


def bench_shape(shape_name: str, args, root: Path) -> list[dict]:
    import shutil

    from miles_core.engine import EngineClient
    from miles_sync.engine_group import form_engine_group
    from miles_sync.weight_sync import SyncConfig, WeightPublisher

    torch.cuda.set_device(0)
    say(f"{shape_name}: writing a random bf16 checkpoint")
    path, weights = write_checkpoint(shape_name, root)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    rows = []
    two_gpu = {"broadcast", "p2p"} & set(args.modes)
    say(f"{shape_name}: {nbytes / 2**30:.2f} GiB in {len(weights)} tensors; measuring the floors")
    ipc_floor = copy_floor(nbytes, args.repeats)
    bcast_floor = broadcast_floor(nbytes, args.repeats) if two_gpu else None
    say(f"{shape_name}: floors {ipc_floor:.4f} s (copy), {bcast_floor} s (broadcast)")

    def row(mode, buffer, seconds, floor, naive=None, stats=None, fixed=None):
        stats = stats or {}
        rows.append(
            dict(
                shape=shape_name,
                mode=mode,
                buffer_bytes=buffer,
                gib=nbytes / 2**30,
                seconds=seconds,
                gib_per_s=nbytes / 2**30 / seconds,
                floor_seconds=floor,
                x_floor=seconds / floor if floor else None,
                fixed_round_s=fixed,
                naive_seconds=naive,
                x_faster_than_naive=naive / seconds if naive else None,
                buckets=stats.get("buckets"),
                phases=stats.get("phases"),  # the last repeat's, trainer rank 0
                delivery_wait_s=stats.get("delivery_wait_s"),
            )
        )

    engines = []
    try:
        if "ipc" in args.modes:
            say(f"{shape_name}: starting the built-in engine on cuda:0 (IPC, colocated)")
            ipc_engine = Engine(path, "cuda:0", free_port(), root)
            engines.append(ipc_engine)
            for buffer in args.buffer_size:
                say(f"{shape_name}: ipc publish x{args.repeats}, {buffer / 2**20:.0f} MiB buckets")
                config = SyncConfig(mode="ipc", colocate=True, buffer_size=buffer)
                publisher = WeightPublisher(config)
                since = ipc_engine.log_offset()
                ipc = timed(
                    lambda p=publisher: p.update_weights(weights.items(), [ipc_engine.url]),
                    args.repeats,
                )
                ipc_stats = publisher.last_stats
                time.sleep(0.5)  # the engine's log lines of the last bucket
                engine_ms = ipc_engine.bucket_ms(since)
                fixed = fixed_round(publisher, ipc_engine.url, args.repeats, weights)
                publisher.close()
                row("ipc", buffer, ipc, ipc_floor, None, ipc_stats, fixed)
                rows[-1]["engine_bucket_ms"] = engine_ms
            if args.naive:
                say(f"{shape_name}: the naive per-tensor IPC publish")
                naive = timed(lambda: naive_ipc(ipc_engine.url, weights), 1)
                row("naive-ipc", None, naive, ipc_floor)
                for r in rows:
                    if r["mode"] == "ipc":
                        r["naive_seconds"] = naive
                        r["x_faster_than_naive"] = naive / r["seconds"]
            ipc_engine.close()
            engines.remove(ipc_engine)
        if two_gpu:
            say(f"{shape_name}: starting the built-in engine on cuda:1 (broadcast, p2p)")
            bcast_engine = Engine(path, "cuda:1", free_port(), root)
            engines.append(bcast_engine)
        if "broadcast" in args.modes:
            naive = None
            if args.naive:
                client = EngineClient(bcast_engine.url, timeout=600)
                group = form_engine_group([client], group_name="naive", backend="nccl")
                naive = timed(lambda: naive_broadcast(group, weights), 1)
                group.close()
                row("naive-broadcast", None, naive, bcast_floor)
            for buffer in args.buffer_size:
                say(
                    f"{shape_name}: broadcast publish x{args.repeats}, "
                    f"{buffer / 2**20:.0f} MiB buckets"
                )
                config = SyncConfig(mode="broadcast", buffer_size=buffer, group_backend="nccl")
                publisher = WeightPublisher(config)
                run = lambda p=publisher: p.update_weights(weights.items(), [bcast_engine.url])  # noqa: E731
                bcast = timed(run, args.repeats)
                bcast_stats = publisher.last_stats
                fixed = fixed_round(publisher, bcast_engine.url, args.repeats, weights)
                publisher.close()
                row("broadcast", buffer, bcast, bcast_floor, naive, bcast_stats, fixed)
        if "p2p" in args.modes and args.p2p_ranks > 1:
            for buffer in args.buffer_size:
                say(
                    f"{shape_name}: p2p publish from {args.p2p_ranks} trainer processes "
                    f"x{args.repeats}, {buffer / 2**20:.0f} MiB buckets"
                )
                try:
                    seconds = p2p_publish(path, bcast_engine.url, args, buffer)
                    row("p2p", buffer, seconds, bcast_floor)
                except RuntimeError as error:  # report it, keep the other rows
                    say(f"{shape_name}: p2p row left out: {error}")
    finally:
        for engine in engines:
            engine.close()
        weights.clear()
        torch.cuda.empty_cache()
        shutil.rmtree(path, ignore_errors=True)  # a 14B checkpoint is ~30 GB of disk
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1.7b", "7b"], choices=sorted(SHAPES))
    parser.add_argument(
        "--buffer-size", type=int, nargs="+", default=[512 * 1024**2], help="bytes; several allowed"
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["ipc", "broadcast", "p2p"],
        choices=["ipc", "broadcast", "p2p"],
    )
    parser.add_argument(
        "--no-naive", dest="naive", action="store_false", help="skip the per-tensor baselines"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--p2p-ranks", type=int, default=2, help="trainer processes (0: no p2p row)"
    )
    parser.add_argument("--p2p-timeout", type=float, default=180.0, help="seconds for the p2p row")
    parser.add_argument("--json", default="bench_weight_sync.json")
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args()
    if {"broadcast", "p2p"} & set(args.modes) and torch.cuda.device_count() < 2:
        sys.exit("bench_weight_sync: --modes broadcast/p2p need 2 GPUs (the engine on GPU 1)")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    root = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_weight_sync_"))
    rows = []
    for shape in args.shapes:
        rows += bench_shape(shape, args, root)
    header = (
        f"{'shape':6} {'mode':16} {'bucket':>7} {'GiB':>7} {'s':>8} {'GiB/s':>8} {'floor s':>8} "
        f"{'x floor':>8} {'round s':>8} {'x naive':>8}"
    )
    print(header)
    for r in rows:
        x_floor = f"{r['x_floor']:.2f}" if r["x_floor"] else "-"
        x_naive = f"{r['x_faster_than_naive']:.1f}" if r["x_faster_than_naive"] else "-"
        bucket = f"{r['buffer_bytes'] / 2**20:.0f}M" if r["buffer_bytes"] else "-"
        fixed = f"{r['fixed_round_s']:.4f}" if r["fixed_round_s"] is not None else "-"
        print(
            f"{r['shape']:6} {r['mode']:16} {bucket:>7} {r['gib']:7.2f} {r['seconds']:8.3f} "
            f"{r['gib_per_s']:8.1f} {r['floor_seconds']:8.4f} {x_floor:>8} {fixed:>8} {x_naive:>8}"
        )
    print("where the time went (last repeat, trainer rank 0, ms):")
    for r in rows:
        if r.get("phases"):
            parts = " ".join(f"{k} {v * 1e3:.1f}" for k, v in r["phases"].items())
            wait = r.get("delivery_wait_s")
            wait = f", of push waiting for the engine {wait * 1e3:.1f}" if wait is not None else ""
            print(
                f"  {r['shape']} {r['mode']} {r['buffer_bytes'] / 2**20:.0f} MiB: "
                f"{r['buckets']} buckets; {parts}{wait}"
            )
            eng = r.get("engine_bucket_ms")
            if eng:
                print(
                    f"    engine, median per bucket ({eng['requests']} requests): decode "
                    f"{eng['decode']:.2f} ms, queued {eng['queued']:.2f} ms, load {eng['load']:.2f} ms"
                )
    Path(args.json).write_text(
        json.dumps({"rows": rows, "buffer_size": args.buffer_size}, indent=1)
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
