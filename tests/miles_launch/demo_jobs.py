"""Test support of the ``miles train`` end-to-end tests on the demo task (test_loop_e2e.py,
test_job_faults_e2e.py, test_ppo_e2e.py): the job's command line, its records, the demo script's
run, the checkpoint comparison. The tiny model and prompts are conftest.py's ``material``."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from miles_core import backends
from miles_launch.demo import demo_flags
from train_runs import dcp_tensors

#: What every such job needs installed.
REQUIRES = [
    pytest.mark.skipif(
        "fsdp" not in backends.available(), reason="the FSDP backend is not installed"
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("miles_sync.weight_sync") is None,
        reason="miles-sync's WeightPublisher (update_weights) is not installed",
    ),
]

ROOT = Path(__file__).resolve().parents[2]
LAST_LINE = re.compile(
    r"^demo: reward first-3 mean (\d+\.\d+) -> last-3 mean (\d+\.\d+) \((\d+) s\)$"
)
SMALL = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "4"]
#: the resume tests' job: 3 rollouts, saving at 2 and 3
RESUMABLE = [*SMALL, "--save-interval", "2", "--num-rollout", "3"]
#: PPO with a critic, 2 rollouts, a checkpoint after each: the job of :func:`ppo_critic_job`
PPO_CRITIC = [
    *SMALL, "--advantage-estimator", "ppo", "--use-critic", "--critic-lr", "1e-2",
    "--gamma", "1.0", "--lambd", "0.95", "--value-clip", "0.5", "--num-rollout", "2",
    "--save-interval", "1",
]  # fmt: skip


def ppo_critic_job(material, out: Path, *flags: str) -> subprocess.CompletedProcess:
    """The :data:`PPO_CRITIC` job (with ``flags``) saving into ``out``: ``metrics.jsonl``,
    ``ckpt/`` and each rollout's data (``rollout_<id>.pt``, ``--save-debug-rollout-data``)."""
    result = train(
        material, out / "metrics.jsonl", *PPO_CRITIC, *flags,
        "--save", str(out / "ckpt"),
        "--save-debug-rollout-data", str(out / "rollout_{rollout_id}.pt"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def train(
    material, metrics: Path, *flags: str, timeout: float = 600, without: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """``miles train`` with the demo's flags (less the flags named in ``without``, with their
    values) and ``flags``."""
    hf, prompts = material
    demo = demo_flags(hf, prompts, metrics)
    for name in without:
        at = demo.index(name)
        del demo[at : at + 2]
    cmd = [sys.executable, "-m", "miles_launch.train", *demo, *flags]
    return subprocess.run(
        cmd + ["--no-progress"], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def records(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if "rollout_id" in r]


def demo(tmp_path: Path, *flags: str) -> tuple[float, float, str]:
    result = subprocess.run(
        [
            sys.executable,
            "scripts/run_demo.py",
            "--output-dir",
            str(tmp_path),
            "--no-progress",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    match = LAST_LINE.match(last)
    assert match, last
    return float(match.group(1)), float(match.group(2)), result.stdout + result.stderr


def rollout_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if re.match(r"^rollout \d+: reward", line)]


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = dcp_tensors(a), dcp_tensors(b)
    assert wa.keys() == wb.keys() and len(wa) > 0
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def err_tail(lines: list[str]) -> str:
    return "".join(lines)[-3000:]
