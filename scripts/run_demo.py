"""The demo: RL on a tiny random Qwen3 with the FSDP backend and the built-in engine, on CPU.

    uv run python scripts/run_demo.py                   # 12 rollouts, a few minutes on 2 cores
    uv run python scripts/run_demo.py --num-rollout 2   # smoke run
    uv run python scripts/run_demo.py --lr 0            # control: no learning, no rise

Makes (never downloads) a tiny Qwen3 checkpoint and a prompt set whose reward a random model
scores about 0.1 (see ``miles_launch.demo``), runs ``miles train --train-backend fsdp`` with
2 trainer ranks and 1 built-in engine (disaggregated), checks that the engine's weight
version rose by one per rollout, prints the reward per rollout, writes ``run.png`` (the
``miles plot`` picture: reward, KL, entropy, response length and phase times), prints where
it is, and ends
with ``demo: reward first-3 mean X -> last-3 mean Y (Z s)``. Any other flag is passed on to
``miles train`` (later flags win).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from miles_launch.demo import build_tiny_qwen3, demo_flags, write_demo_prompts
from miles_launch.plot import write_run_plot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default="demo_output", help="run.png, metrics, logs")
    parser.add_argument("--num-rollout", type=int, default=12)
    parser.add_argument("--lr", default=None, help="override the demo's learning rate")
    ours, extra = parser.parse_known_args()
    start = time.monotonic()
    out = Path(ours.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="miles-demo-"))
    hf_dir = build_tiny_qwen3(work / "tiny-qwen3")
    prompts = write_demo_prompts(work / "prompts.jsonl")
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    flags = demo_flags(hf_dir, prompts, metrics) + ["--num-rollout", str(ours.num_rollout)]
    if ours.lr is not None:
        flags += ["--lr", ours.lr]
    cmd = [sys.executable, "-m", "miles_launch.train", *flags, *extra]
    print("$ miles train " + " ".join(flags + extra), flush=True)
    code = subprocess.call(cmd)
    if code != 0:
        print(f"demo: miles train failed with exit status {code}", file=sys.stderr)
        sys.exit(code)

    everything = [json.loads(line) for line in metrics.read_text().splitlines()]
    everything = [r for r in everything if "rollout_id" in r]
    records = [r for r in everything if r["rollout_id"] >= 0]  # -1: the eval before training
    rewards = [r["rollout"]["reward_mean"] for r in records]
    for r in records:
        print(
            f"rollout {r['rollout_id'] + 1}: reward {r['rollout']['reward_mean']:.3f} "
            f"(generated with weight version {r['rollout']['generated_with_versions']})"
        )
    # each rollout is generated with one weight version, newer than the previous rollout's (one
    # publish per rollout; evaluating other weights, e.g. --eval-weights ema, adds two)
    versions = [r["rollout"]["generated_with_versions"] for r in records]
    single = all(len(v) == 1 for v in versions)
    if not single or any(b[0] <= a[0] for a, b in zip(versions, versions[1:])):
        print(
            f"demo: engine weight versions {versions}: expected one rising version per rollout",
            file=sys.stderr,
        )
        sys.exit(1)
    write_run_plot(everything, out / "run.png", title=f"demo: {len(records)} rollouts")
    print(f"demo: picture at {out / 'run.png'} (miles plot {out} draws it again)")
    first = sum(rewards[:3]) / len(rewards[:3])
    last = sum(rewards[-3:]) / len(rewards[-3:])
    elapsed = time.monotonic() - start
    print(f"demo: reward first-3 mean {first:.3f} -> last-3 mean {last:.3f} ({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
