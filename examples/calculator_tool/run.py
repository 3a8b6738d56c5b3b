"""Train the tiny demo model on the calculator-tool task (CPU, built-in engine) and print the
reward of the first and last rollouts.

    uv run python examples/calculator_tool/run.py --output-dir /tmp/calc [--num-rollout 12]
        [--baseline]

``--baseline`` also runs the same job with ``--lr 0`` (no learning) and prints both runs side
by side; ``summary.json`` in the output directory holds the per-rollout rewards.

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


def train(out: Path, hf: Path, prompts: Path, num_rollout: int, progress: bool, *extra: str):
    """One ``miles train`` job; its per-rollout records."""
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "miles_launch.train"]
    cmd += calculator_flags(hf, prompts, metrics, num_rollout) + list(extra)
    cmd += [] if progress else ["--no-progress"]
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    subprocess.run(cmd, check=True, env=dict(os.environ, PYTHONPATH=path))
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "rollout_id" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--num-rollout", type=int, default=12)
    parser.add_argument("--baseline", action="store_true", help="also run with --lr 0")
    parser.add_argument("--no-progress", action="store_true")
    ns = parser.parse_args()
    out = ns.output_dir
    out.mkdir(parents=True, exist_ok=True)
    hf = build_tiny_qwen3(out / "tiny-qwen3")
    prompts = write_prompts(out / "prompts.jsonl")
    runs = {"trained": train(out / "trained", hf, prompts, ns.num_rollout, not ns.no_progress)}
    if ns.baseline:
        runs["lr 0"] = train(
            out / "lr0", hf, prompts, ns.num_rollout, not ns.no_progress, "--lr", "0"
        )
    rewards = {name: [r["rollout"]["reward_mean"] for r in recs] for name, recs in runs.items()}
    masked = {
        name: [r["rollout"]["loss_token_fraction"] for r in recs] for name, recs in runs.items()
    }
    print("rollout  " + "  ".join(f"{name:>8} reward  loss-tok" for name in runs))
    for i in range(ns.num_rollout):
        cells = [f"{rewards[n][i]:15.3f}  {masked[n][i]:8.3f}" for n in runs]
        print(f"{i:7d}  " + "  ".join(cells))
    k = min(3, ns.num_rollout)
    summary = {}
    for name, values in rewards.items():
        first, last = sum(values[:k]) / k, sum(values[-k:]) / k
        summary[name] = {"rewards": values, "loss_token_fraction": masked[name]}
        print(f"calculator ({name}): reward first-{k} mean {first:.3f} -> last-{k} mean {last:.3f}")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
