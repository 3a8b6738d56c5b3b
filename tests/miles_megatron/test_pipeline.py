"""Pipeline parallelism on 2 gloo ranks: PP=2 (megatron's 1F1B schedule, the loss on the last
stage, the old log-probs broadcast from it) trains exactly like PP=1 (here TP=2) over 2 rollouts
of 2 optimizer steps, and the PP=2 checkpoint loads at PP=1 (reshard) bit for bit. The run
shares its spawn with test_layouts.py (conftest.py's ``two_rank_run``)."""

from __future__ import annotations

import pytest
from megatron_ranks import check_pipeline


@pytest.mark.slow
def test_pp2_trains_like_pp1_and_its_save_loads_at_pp1(two_rank_run):
    r0, r1 = (r["pipeline"] for r in two_rank_run)
    check_pipeline(r0, r1)
