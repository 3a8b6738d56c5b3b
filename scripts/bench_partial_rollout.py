"""Generation time and wasted tokens of over-sampled rollouts, with and without
``--partial-rollout``, on one built-in engine (same model, prompts and seeds).

    uv run python scripts/bench_partial_rollout.py --out bench_partial_rollout.json
    uv run python scripts/bench_partial_rollout.py --model-path /models/Qwen3-0.6B \\
        --prompt-data prompts.jsonl --device cuda --out gpu.json

Each mode draws ``--num-rollout`` rollouts through the launcher's own ``draw_groups`` and
``Generator`` (``--dynamic-filter``, ``--over-sampling-batch-size``, the demo's
``label-char-fraction`` reward): ``wait`` generates every over-sampled group to the end,
``partial`` aborts the engine once enough groups passed and continues the cut-short groups in
the next rollout. The weights are not changed between rollouts (the benchmark measures
generation only; a real run publishes between them). Reported per mode: mean wall time of a
rollout's generation, tokens generated, tokens in the trained groups, tokens thrown away
(groups generated and not trained: surplus and filtered out; carried groups are not thrown
away), and groups carried. Prints a table and writes JSON (``--out``). Not a timed assertion.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from miles_core.ports import free_port
from miles_launch.demo import build_tiny_qwen3, write_demo_prompts
from miles_launch.job import LauncherState
from miles_launch.rollout.draw import draw_groups
from miles_launch.rollout.generate import Generator, SamplingConfig
from miles_launch.rollout.partial import PartialBuffer, unfinished
from miles_launch.rollout.prompts import load_prompts
from miles_launch.rollout.rewards import RewardModel, label_char_fraction
from transformers import AutoTokenizer


def start_engine(args, model_path: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "miles_launch.builtin_engine", "--model-path", str(model_path)]
    cmd += ["--port", str(port), "--device", args.device]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise TimeoutError("engine did not become healthy")


def run_mode(args, url: str, prompts: list, partial: bool) -> dict:
    async def alive(when):
        pass

    cfg = SamplingConfig(args.max_new_tokens, 1.0, 1.0, -1, args.seed)
    reward = RewardModel(label_char_fraction, "label-char-fraction")
    state, buffer = LauncherState(0, 0), PartialBuffer() if partial else None
    totals = {"generated": 0, "trained": 0, "thrown_away": 0, "groups_carried": 0}
    times = []

    seen: list = []  # the groups generated in the current rollout

    def generate(items, carried=None, need=None):
        async def run():
            gen = Generator([url], reward, alive, abort_urls=[url] if partial else None)
            try:
                return await gen.groups(items, args.n, cfg, carried=carried, need=need)
            finally:
                await gen.aclose()

        before = {id(s) for group in (carried or {}).values() for s in group}
        groups = asyncio.run(run())
        seen.extend(groups)
        totals["generated"] += sum(
            len(s.response_ids) - s.resumed_tokens
            for group in groups
            for s in group
            if id(s) not in before  # a carried finished sample was generated before
        )
        return groups

    for _ in range(args.num_rollout):
        seen.clear()
        start = time.perf_counter()
        kept, info = draw_groups(
            state,
            lambda s, c: [(prompts[(s + j) % len(prompts)], s + j) for j in range(c)],
            generate,
            want=args.rollout_batch_size,
            max_draws=4,
            dynamic_filter=True,
            over_sampling=args.over_sampling_batch_size,
            partial=buffer,
        )
        times.append(time.perf_counter() - start)
        kept_ids = {id(g) for g in kept}
        for group in seen:
            tokens = sum(len(s.response_ids) for s in group)
            if id(group) in kept_ids:
                totals["trained"] += tokens
            elif not unfinished(group):  # surplus or filtered out (a carried group is not)
                totals["thrown_away"] += tokens
        totals["groups_carried"] += info.get("groups_carried", 0)
    return {"rollout_generate_s_mean": sum(times) / len(times), "rollout_s": times, **totals}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-path", default=None, help="HF model dir; default: the demo's model")
    p.add_argument("--prompt-data", default=None, help="JSONL prompt/label; default: the demo's")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-rollout", type=int, default=6)
    p.add_argument("--rollout-batch-size", type=int, default=4)
    p.add_argument("--over-sampling-batch-size", type=int, default=12)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = Path(args.model_path) if args.model_path else build_tiny_qwen3(tmp / "model")
        data = args.prompt_data or write_demo_prompts(tmp / "prompts.jsonl")
        tokenizer = AutoTokenizer.from_pretrained(model)
        prompts = load_prompts(data, tokenizer, "prompt", "label", False)
        proc, url = start_engine(args, model, tmp / "engine.log")
        try:
            results = {mode: run_mode(args, url, prompts, mode == "partial") for mode in
                       ("wait", "partial")}  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(timeout=30)

    print(f"{'mode':8} {'gen s/rollout':>14} {'generated':>10} {'trained':>8} "
          f"{'thrown away':>12} {'carried':>8}")  # fmt: skip
    for mode, r in results.items():
        print(
            f"{mode:8} {r['rollout_generate_s_mean']:14.3f} {r['generated']:10d} "
            f"{r['trained']:8d} {r['thrown_away']:12d} {r['groups_carried']:8d}"
        )
    if args.out:
        record = {
            "args": vars(args),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "results": results,
        }
        Path(args.out).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
