"""Pipeline parallelism on 2 gloo ranks: PP=2 (megatron's 1F1B schedule, the loss on the last
stage, the old log-probs broadcast from it) trains exactly like PP=1 (here TP=2) over 2 rollouts
of 2 optimizer steps, and the PP=2 checkpoint loads at PP=1 (reshard) bit for bit."""

from __future__ import annotations

import pytest
from dist_ranks import spawn_ranks
from megatron_ranks import check_pipeline, pipeline_run
from megatron_tiny_models import make_tiny_hf


@pytest.mark.slow
def test_pp2_trains_like_pp1_and_its_save_loads_at_pp1(tmp_path):
    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    r0, r1 = spawn_ranks(pipeline_run, 2, hf_dir, str(tmp_path / "ckpt"), timeout=500)
    check_pipeline(r0, r1)
