"""``miles train --true-on-policy`` on the demo task: the built-in engine and the two FSDP
ranks (gloo, CPU, fp32) run the batch-invariant mode, and every rollout's train/rollout
mismatch (the training forward's log-probs against the engine's) is exactly 0, token maximum
included. Without the mode the demo's smoke run (test_loop_e2e.py) reports it nonzero.

One optimizer step per rollout: with more, a later step's training forward sees weights the
engine did not sample with.
"""

from __future__ import annotations

import pytest
from demo_jobs import REQUIRES, SMALL, records, train

pytestmark = [pytest.mark.slow, pytest.mark.extended, *REQUIRES]


def test_the_mismatch_is_exactly_zero_on_every_rollout(material, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    result = train(
        material,
        metrics,
        *SMALL,
        "--num-rollout", "2",
        "--num-steps-per-rollout", "1",
        "--true-on-policy",
        without=("--attn-implementation",),  # the mode brings its own attention
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    trained = [r["train"] for r in records(metrics) if r["rollout_id"] >= 0]
    assert len(trained) == 2
    for t in trained:
        assert t["train_rollout_logprob_abs_diff"] == 0.0, t
        assert t["train_rollout_logprob_abs_diff_max"] == 0.0, t
        assert t["train_rollout_is_ratio_min"] == t["train_rollout_is_ratio_max"] == 1.0, t
