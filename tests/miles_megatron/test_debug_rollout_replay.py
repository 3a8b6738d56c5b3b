"""``--load-debug-rollout-data`` on the megatron backend: ``miles train`` at TP=2 on 2 gloo
ranks with a built-in CPU engine saves 2 rollouts' data; the same run replayed with no engine
ends with a checkpoint equal to the live one bit for bit (FSDP:
tests/miles_launch/test_debug_rollout_data.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megatron_cli import megatron_cli_env
from train_runs import dcp_tensors, metric_records

ROOT = Path(__file__).resolve().parents[2]


def flags(hf: Path, prompts: Path, metrics: Path) -> list[str]:
    return [
        "--train-backend", "megatron", "--no-bf16", "--hf-checkpoint", str(hf),
        "--prompt-data", str(prompts), "--input-key", "prompt", "--label-key", "label",
        "--rm-type", "label-char-fraction",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2",
        "--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "8", "--rollout-temperature", "1.0",
        "--advantage-estimator", "grpo", "--num-steps-per-rollout", "2", "--micro-batch-size", "2",
        "--lr", "1e-2", "--weight-decay", "0.0", "--clip-grad", "1.0",
        "--save-interval", "1", "--metrics-jsonl", str(metrics), "--no-progress",
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.extended
def test_megatron_replay_without_engines_equals_the_live_run(tmp_path):
    from miles_launch.demo import build_tiny_qwen3, write_demo_prompts

    hf = build_tiny_qwen3(tmp_path / "tiny-qwen3")
    prompts = write_demo_prompts(tmp_path / "prompts.jsonl")
    data = str(tmp_path / "rollouts" / "rollout_{rollout_id}.pt")
    for name, extra in (
        ("live", ["--rollout-engine", "builtin", "--rollout-num-gpus", "1",
                  "--save-debug-rollout-data", data]),
        ("replay", ["--load-debug-rollout-data", data]),
    ):  # fmt: skip
        cmd = [
            sys.executable,
            "-m",
            "miles_launch.train",
            *flags(hf, prompts, tmp_path / f"{name}.jsonl"),
        ]
        cmd += [*extra, "--save", str(tmp_path / name / "ckpt")]
        run = subprocess.run(
            cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=megatron_cli_env()
        )
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    live, replay = (metric_records(tmp_path / f"{name}.jsonl") for name in ("live", "replay"))
    assert len(live) == 2 and [r["train"] for r in live] == [r["train"] for r in replay]
    iters = sorted(p.name for p in (tmp_path / "live" / "ckpt").glob("iter_*"))
    a = dcp_tensors(tmp_path / "live" / "ckpt" / iters[-1])
    b = dcp_tensors(tmp_path / "replay" / "ckpt" / iters[-1])
    assert a.keys() == b.keys() and len(a) > 0
    for key in a:
        assert torch.equal(a[key], b[key]), key
    first = dcp_tensors(tmp_path / "live" / "ckpt" / iters[0])
    assert any(not torch.equal(first[k], a[k]) for k in a)  # the second rollout moved them
