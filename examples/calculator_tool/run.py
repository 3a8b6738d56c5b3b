"""Train the tiny demo model on the calculator-tool task (CPU, built-in engine) and print the
reward of the first and last rollouts.

    uv run python examples/calculator_tool/run.py --output-dir /tmp/calc [--num-rollout 12]

The job is ``miles train`` with the demo's flags (2 gloo trainer ranks, 1 built-in engine)
plus ``--custom-generate-function-path calculator:generate``; this folder goes on
``PYTHONPATH`` so the launcher can import the function.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from calculator import write_prompts  # noqa: E402
from miles_launch.demo import build_tiny_qwen3, demo_flags  # noqa: E402


def calculator_flags(hf_dir: Path, prompts: Path, metrics: Path, num_rollout: int) -> list[str]:
    flags = demo_flags(hf_dir, prompts, metrics)
    i = flags.index("--rm-type")
    del flags[i : i + 2]  # the generate function returns the reward
    flags[flags.index("--num-rollout") + 1] = str(num_rollout)
    flags[flags.index("--rollout-max-response-len") + 1] = "12"
    return flags + ["--custom-generate-function-path", "calculator:generate"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--num-rollout", type=int, default=12)
    parser.add_argument("--no-progress", action="store_true")
    ns = parser.parse_args()
    out = ns.output_dir
    out.mkdir(parents=True, exist_ok=True)
    hf = build_tiny_qwen3(out / "tiny-qwen3")
    prompts = write_prompts(out / "prompts.jsonl")
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "miles_launch.train"]
    cmd += calculator_flags(hf, prompts, metrics, ns.num_rollout)
    cmd += ["--no-progress"] if ns.no_progress else []
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    )
    subprocess.run(cmd, check=True, env=env)
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if "rollout_id" in r]
    rewards = [r["rollout"]["reward_mean"] for r in records]
    masked = [r["rollout"]["loss_token_fraction"] for r in records]
    for r, reward, frac in zip(records, rewards, masked):
        print(f"rollout {r['rollout_id']:3d}  reward {reward:.3f}  loss-token fraction {frac:.3f}")
    k = min(3, len(rewards))
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    print(f"calculator: reward first-{k} mean {first:.3f} -> last-{k} mean {last:.3f}")


if __name__ == "__main__":
    main()
