"""The loop end to end: ``miles train --train-backend fsdp`` on Ray with 2 gloo trainer ranks
and 1 built-in CPU engine (disaggregated), as subprocesses of the real CLI.

Slow (each job starts Ray, two trainer actors and an engine). The default suite keeps one
representative run, the demo smoke; the rest (colocated equals disaggregated, the ``--lr 0``
control, ``--fully-async`` overlap, the calculator example, partial rollout) are ``extended``,
which CI runs too. Jobs that fail (an engine or a trainer rank killed) and resume are
test_job_faults_e2e.py's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from demo_jobs import REQUIRES, ROOT, SMALL, demo, records, rollout_lines, train
from miles_launch.demo import demo_flags, write_demo_prompts

pytestmark = [pytest.mark.slow, *REQUIRES]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The CI smoke run of the demo: 2 rollouts, disaggregated."""
    out = tmp_path_factory.mktemp("smoke")
    return out, *demo(out, "--num-rollout", "2")


def test_demo_smoke_two_rollouts(smoke):
    out_dir, _, _, out = smoke
    assert (out_dir / "run.png").read_bytes()[:4] == b"\x89PNG"
    assert f"demo: picture at {out_dir / 'run.png'}" in out
    # the script checked that the engine's weight version rose by one per rollout
    lines = rollout_lines(out)
    assert [line.split(" (")[1] for line in lines] == [
        "generated with weight version [1])",
        "generated with weight version [2])",
    ]
    # the engine returned log-probs: each trained rollout reports the train/rollout mismatch
    trained = [r for r in records(out_dir / "metrics.jsonl") if r["rollout_id"] >= 0]
    assert len(trained) == 2
    for r in trained:
        # nonzero: without --true-on-policy the two sides round differently (test_true_on_policy_e2e)
        assert 0.0 < r["train"]["train_rollout_logprob_abs_diff"] < 1.0, r["train"]
        assert r["train"]["train_rollout_is_ratio_std"] >= 0.0
        t = r["train"]  # the extremes reach the JSONL beside the means
        assert t["train_rollout_logprob_abs_diff_max"] >= t["train_rollout_logprob_abs_diff"]
        ratio = t["train_rollout_is_ratio_mean"]
        assert t["train_rollout_is_ratio_min"] <= ratio <= t["train_rollout_is_ratio_max"]
        assert (
            0.0
            <= t["train_rollout_logprob_abs_diff_sample_max"]
            <= (t["train_rollout_logprob_abs_diff_max"])
        )


@pytest.mark.extended
def test_colocated_run_matches_the_disaggregated_one(smoke, tmp_path):
    """--colocate: 2 engines on the trainer's 2 slots, trainer asleep during generation,
    engine memory released during training, weights over IPC (shared memory on CPU). Same
    seeds and exact weight transfer: the same samples, so the same reward per rollout."""
    _, _, _, out = smoke
    _, _, colocated = demo(tmp_path, "--num-rollout", "2", "--colocate")
    assert "engines: 2 builtin engine(s) x 1 CPU slot, colocated" in colocated
    assert rollout_lines(colocated) == rollout_lines(out)


@pytest.mark.extended
def test_lr_zero_gives_no_rise(tmp_path):
    """Also evaluates with the EMA weights: each eval (the one before training included)
    publishes EMA, then the actor again."""
    evals = write_demo_prompts(tmp_path / "eval.jsonl", num_prompts=4, seed=7)
    first, last, out = demo(
        tmp_path, "--num-rollout", "6", "--lr", "0",
        "--eval-interval", "3", "--eval-prompt-data", "held-out", str(evals),
        "--use-ema", "--eval-weights", "ema",
    )  # fmt: skip
    eval_line = r"\| held-out \| reward_mean \d\.\d{4} \| response_len_mean \d+\.\d{4} \| pass@1 "
    assert re.search(r"^eval before training " + eval_line, out, re.M), out
    assert re.search(r"^eval after rollout 3 " + eval_line, out, re.M), out
    assert re.search(r"^eval after rollout 6 " + eval_line, out, re.M)
    versions = [int(line.split("[")[1].rstrip("])")) for line in rollout_lines(out)]
    # one publish per rollout, plus two around each of the evals before training and after
    # rollout 3 (EMA, then the actor)
    assert versions == [3, 4, 5, 8, 9, 10], out
    # the learning demo climbs by >= 0.2 over 12 rollouts; without updates the policy is fixed
    assert first >= 0.05
    assert last < first + 0.1, out


@pytest.mark.extended
def test_fully_async_overlaps_generation_and_training(material, tmp_path):
    """PPO with a critic under --fully-async: each rollout's critic phase scores and trains
    before the actor (the first, --num-critic-only-steps 1, trains only the critic). On-policy
    only (--max-weight-staleness 0): groups a publish made stale are dropped and counted."""
    ppo = ["--advantage-estimator", "ppo", "--use-critic", "--num-critic-only-steps", "1"]
    result = train(
        material, tmp_path / "m.jsonl", *SMALL, "--num-rollout", "3", "--fully-async", *ppo,
        "--max-weight-staleness", "0",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rs = records(tmp_path / "m.jsonl")
    assert [r["rollout_id"] for r in rs] == [0, 1, 2]
    assert "loss" not in rs[0]["train"] and "critic/value_loss" in rs[0]["train"]
    for r in rs[1:]:
        assert {"loss", "critic/value_loss"} <= set(r["train"]), r["train"]
    for r in rs:
        stats = r["rollout"]
        assert 0.0 <= stats["overlap_s"] <= r["time"]["train"] + 1e-6
        assert stats["staleness_max"] == stats["staleness_mean"] == 0  # the bound held
        assert stats["stale_groups_dropped"] >= 0
    # generation ran during training (measured from request intervals), and is logged
    assert sum(r["rollout"]["overlap_s"] for r in rs) > 0
    assert "generation overlapped" in result.stderr
    assert "staleness" in result.stdout


@pytest.mark.extended
def test_calculator_example_with_rollout_control(material, tmp_path):
    """examples/calculator_tool through ``miles train`` with over-sampling under the dynamic
    filter and the prompt-length limit: tool tokens are masked out of the loss, long prompts
    never drawn, each rollout full."""
    hf, _ = material
    example = ROOT / "examples" / "calculator_tool"
    sys.path.insert(0, str(example))
    try:
        import calculator
    finally:
        sys.path.remove(str(example))
    prompts = calculator.write_prompts(tmp_path / "prompts.jsonl", num_prompts=24)
    with open(prompts, "a", encoding="utf-8") as f:  # prompts 24..27: 28 tokens each
        for _ in range(4):
            f.write(json.dumps({"prompt": "add 1 2 " + "x" * 20, "label": "3"}) + "\n")
    metrics = tmp_path / "metrics.jsonl"
    flags = demo_flags(hf, prompts, metrics)
    for flag, value in (("--num-rollout", "2"), ("--rollout-max-response-len", "12")):
        flags[flags.index(flag) + 1] = value
    flags += [
        "--custom-generate-function-path", "calculator:generate",
        "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "4",
        "--dynamic-filter",
        "--over-sampling-batch-size", "4",
        "--rollout-max-prompt-len", "10",
    ]  # fmt: skip
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(example), os.environ.get("PYTHONPATH", "")])
    )
    result = subprocess.run(
        [sys.executable, "-m", "miles_launch.train", *flags, "--no-progress"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = records(metrics)
    assert [r["rollout_id"] for r in runs] == [0, 1]
    for r in runs:
        stats = r["rollout"]
        assert stats["prompts_too_long"] == 4 and len(r["prompt_ids"]) == 2
        assert not set(r["prompt_ids"]) & {24, 25, 26, 27}
        assert "groups_surplus" in stats and stats["draws"] >= 1
        assert stats["num_samples"] == 8
    assert min(r["rollout"]["loss_token_fraction"] for r in runs) < 1.0  # a tool was called


@pytest.mark.extended
def test_partial_rollout_carries_groups_between_rollouts(material, tmp_path):
    """``--partial-rollout`` through ``miles train``: what a rollout cuts short the next one
    resumes first, every rollout is full, and continued samples train (their continuation only:
    ``--mask-offpolicy-in-partial-rollout`` keeps the carried tokens out of the loss)."""
    metrics = tmp_path / "metrics.jsonl"
    result = train(
        material,
        metrics,
        "--num-rollout", "4",
        "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "64",
        "--dynamic-filter",
        "--over-sampling-batch-size", "8",
        "--partial-rollout",
        "--mask-offpolicy-in-partial-rollout",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    stats = [r["rollout"] for r in records(metrics)]
    assert len(stats) == 4 and all(s["num_samples"] == 8 for s in stats)
    assert stats[0]["groups_resumed"] == 0
    for before, after in zip(stats, stats[1:]):
        assert after["groups_resumed"] == before["groups_carried"]
    assert sum(s["groups_carried"] for s in stats[:-1]) >= 1
    assert sum(s["samples_continued"] for s in stats) >= 1
    # a rollout that continued samples trained fewer than all of its tokens (no tool masks here)
    continued = [s for s in stats if s["samples_continued"]]
    assert min(s["loss_token_fraction"] for s in continued) < 1.0
    assert all(s["loss_token_fraction"] == 1.0 for s in stats if not s["samples_continued"])
