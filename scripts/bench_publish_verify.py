"""Benchmark what ``--update-weight-verify`` adds to a publish: one trainer process on CPU
publishing (``broadcast``, gloo) to one built-in CPU engine, with and without the read-back.

    python scripts/bench_publish_verify.py --sizes 64 256 --json bench_publish_verify.json

Each size is the hidden size of a 2-layer fp32 Qwen3 (vocabulary 4096, intermediate 2x hidden)
with random weights, written as a HF checkpoint that the engine loads. Rows, median of
``--repeats`` publishes after one warm-up each: ``publish`` (the baseline, same run) and
``publish + verify``; the verify row's ratio is against the baseline. Prints a table and writes
JSON; asserts nothing.
"""

from __future__ import annotations

import argparse
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
from miles_core.ports import free_port


def write_model(path: Path, hidden: int):
    from miles_launch.tiny_model import save_char_tokenizer, tiny_qwen3

    model = tiny_qwen3(
        0,
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        head_dim=hidden // 4,
        max_position_embeddings=256,
    )
    model.save_pretrained(path)
    save_char_tokenizer(path, vocab_size=4096)
    return model


def start_engine(path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "miles_launch.builtin_engine", "--model-path", str(path)]
    cmd += ["--port", str(port), "--device", "cpu"]
    log = open(path / "engine.log", "wb")  # noqa: SIM115 (the child keeps it)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError((path / "engine.log").read_text()[-3000:])
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("engine did not become healthy")


def time_publishes(model, url: str, verify: bool, repeats: int) -> list[float]:
    from miles_sync.weight_sync import SyncConfig, WeightPublisher

    config = SyncConfig(mode="broadcast", group_timeout_s=120, verify=verify)
    publisher = WeightPublisher(config)
    times = []
    try:
        for i in range(repeats + 1):
            with torch.no_grad():
                next(model.parameters()).add_(1e-3)  # a new state every publish
            state = [(n, t.detach().contiguous()) for n, t in model.state_dict().items()]
            start = time.perf_counter()
            publisher.update_weights(iter(state), [url])
            if i:  # the first one is the warm-up (group formation)
                times.append(time.perf_counter() - start)
    finally:
        publisher.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="bench_publish_verify.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    rows = []
    for hidden in args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "model"
            model = write_model(path, hidden)
            numel = sum(t.numel() for t in model.state_dict().values())
            engine, url = start_engine(path)
            try:
                base = statistics.median(time_publishes(model, url, False, args.repeats))
                checked = statistics.median(time_publishes(model, url, True, args.repeats))
            finally:
                engine.kill()
                engine.wait()
        rows.append(
            dict(
                hidden=hidden,
                params=numel,
                mbytes=round(numel * 4 / 2**20, 2),
                publish_s=round(base, 4),
                verify_s=round(checked, 4),
                ratio=round(checked / base, 1),
            )
        )
        print(
            f"hidden {hidden:5d} | {numel / 1e6:6.2f} M fp32 params | publish {base:7.3f} s | "
            f"publish + verify {checked:7.3f} s | x{checked / base:.1f}",
            flush=True,
        )
    out = {"date": datetime.date.today().isoformat(), "repeats": args.repeats, "rows": rows}
    Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
