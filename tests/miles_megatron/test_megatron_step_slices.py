"""Megatron at DP 2 takes the same optimizer steps as at DP 1: the RL recipe of cp_ranks (two
steps per rollout, two prompt groups of two samples) at TP 2 (DP 1) and at DP 2, where each
DP rank holds one prompt group, so one rank has no sample in a step (one empty micro-batch).
Before miles-core's ``split_steps`` cut the steps from the whole rollout, DP 2 halved each
rank's shard instead: a step held one sample of each group, and the runs differed."""

from __future__ import annotations

import numpy as np
import pytest
from tolerances import FP32_EPS, GRAD_REL_ERR

VALUE_ATOL = 8 * FP32_EPS * 8


@pytest.mark.extended
@pytest.mark.numeric
def test_dp2_takes_the_steps_of_dp1(layout_hf_dirs):
    from cp_ranks import cp_argv, rl_layouts
    from dist_ranks import spawn_ranks
    from test_context_parallel import MISMATCH_KEYS

    layouts = [("tp2", cp_argv(tp=2)), ("dp2", cp_argv())]
    results = spawn_ranks(rl_layouts, 2, layout_hf_dirs["llama"], layouts, None, timeout=900)
    for rank, r in enumerate(results):
        base, got = r["tp2"], r["dp2"]
        for step, (a, b) in enumerate(zip(base["metrics"], got["metrics"], strict=True)):
            assert a["steps"] == b["steps"] == 2
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=GRAD_REL_ERR), step
            for key in ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "kl_loss"):
                assert abs(a[key] - b[key]) <= VALUE_ATOL, (rank, step, key, a[key], b[key])
            for key in MISMATCH_KEYS:  # extremes over DP ranks, one with an empty micro-batch
                tol = VALUE_ATOL * max(1.0, abs(a[key]))
                assert abs(a[key] - b[key]) <= tol, (rank, step, key, a[key], b[key])
        worst = max(np.abs(base["weights"][k] - got["weights"][k]).max() for k in base["weights"])
        assert worst < 1e-4, (rank, worst)  # Adam moves each weight ~lr = 1e-3 per step
