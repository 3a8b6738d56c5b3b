"""MegatronBackend end to end on 2 gloo ranks at TP=2: each of two rollouts' steps through DDP
and the distributed optimizer matches the float64 HF + AdamW step from the weights it started
from (backend_reference.check: loss, grad norm, per-token log-probs and entropies, every
weight after the step), the TP peers share one data-parallel rank, and the checkpoint resumes
at TP=1 bit-exact."""

from __future__ import annotations

import pytest
from backend_reference import check
from dist_ranks import spawn_ranks
from megatron_ranks import backend_run
from megatron_tiny_models import make_tiny_hf


@pytest.mark.slow
def test_train_matches_hf_adamw_and_resumes_at_tp1(tmp_path):
    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    results = spawn_ranks(backend_run, 2, hf_dir, str(tmp_path / "ckpt"), 2, timeout=500)
    assert [r["layout"].dp_size for r in results] == [1, 1]
    assert [r["layout"].consumes_data for r in results] == [True, False]
    check(results, hf_dir)
