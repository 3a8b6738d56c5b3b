"""PPO with a Megatron critic end to end: ``miles train --train-backend megatron --use-critic
--advantage-estimator ppo`` on the demo task, colocated (the actor and the critic sleep during
generation and each wakes for its phase), at TP=2 with sequence parallelism on 2 gloo ranks and
1 built-in CPU engine. Extended (Ray, two trainer actors, an engine); the critic's numerics and
its resume are checked in-process by test_megatron_critic.py, in the default suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megatron_cli import megatron_cli_env
from test_debug_rollout_replay import flags
from train_runs import dcp_tensors, metric_records

ROOT = Path(__file__).resolve().parents[2]
PPO = [
    "--advantage-estimator", "ppo", "--use-critic", "--critic-lr", "1e-2",
    "--normalize-advantages", "--gamma", "1.0", "--lambd", "0.95", "--value-clip", "0.5",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.extended
def test_colocated_megatron_ppo_trains_the_critic_and_checkpoints_it(tmp_path):
    from miles_launch.demo import build_tiny_qwen3, write_demo_prompts

    hf = build_tiny_qwen3(tmp_path / "tiny-qwen3")
    prompts = write_demo_prompts(tmp_path / "prompts.jsonl")
    metrics = tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "-m", "miles_launch.train", *flags(hf, prompts, metrics), *PPO]
    cmd += ["--rollout-engine", "builtin", "--rollout-num-gpus", "1", "--colocate"]
    cmd += ["--save", str(tmp_path / "ckpt")]
    run = subprocess.run(
        cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=megatron_cli_env()
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    rows = metric_records(metrics)
    assert [r["rollout_id"] for r in rows] == [0, 1]
    for row in rows:
        assert {"loss", "critic/value_loss", "critic/value_clipfrac"} <= set(row["train"])
    critic = tmp_path / "ckpt" / "critic"
    first, last = dcp_tensors(critic / "iter_0000001"), dcp_tensors(critic / "iter_0000002")
    heads = [k for k in last if k.endswith("output_layer.weight")]
    assert heads and all(last[k].shape[0] == 1 for k in heads)  # the value head, not the LM head
    assert any(not torch.equal(first[k], last[k]) for k in last)  # the critic trained
    assert (tmp_path / "ckpt" / "iter_0000002").is_dir()  # the actor's beside it
