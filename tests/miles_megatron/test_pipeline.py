"""Pipeline parallelism on 2 gloo ranks: PP=2 (megatron's 1F1B schedule, the loss on the last
stage, the old log-probs broadcast from it) trains exactly like PP=1 (here TP=2) over 2 rollouts
of 2 optimizer steps, and the PP=2 checkpoint loads at PP=1 (reshard) bit for bit."""

from __future__ import annotations

import pytest
import torch
from dist_ranks import spawn_ranks
from megatron_ranks import pipeline_run
from megatron_tiny_models import make_tiny_hf


@pytest.mark.slow
def test_pp2_trains_like_pp1_and_its_save_loads_at_pp1(tmp_path):
    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    r0, r1 = spawn_ranks(pipeline_run, 2, hf_dir, str(tmp_path / "ckpt"), timeout=500)
    assert [r0["pp2_consumes"], r1["pp2_consumes"]] == [True, False]  # stage 0 reads the data
    for m0, m1 in zip(r0["pp2"], r1["pp2"], strict=True):  # the last stage's, on both stages
        m0.pop("tokens_per_s"), m1.pop("tokens_per_s")  # timed per rank
        assert m0 == m1
    for pp2, pp1 in zip(r0["pp2"], r0["pp1"], strict=True):
        assert abs(pp2["loss"] - pp1["loss"]) < 1e-5, (pp2, pp1)
        assert abs(pp2["grad_norm"] - pp1["grad_norm"]) < 1e-5, (pp2, pp1)
        assert abs(pp2["entropy"] - pp1["entropy"]) < 1e-5, (pp2, pp1)
    assert r0["pp2"][0]["loss"] != r0["pp2"][1]["loss"]

    # each stage publishes its own layers; together they are the whole model
    stage0, stage1 = r0["pp2_weights"], r1["pp2_weights"]
    assert not set(stage0) & set(stage1)
    assert "model.embed_tokens.weight" in stage0 and "lm_head.weight" in stage1
    assert "model.layers.0.mlp.up_proj.weight" in stage0
    assert "model.layers.1.mlp.up_proj.weight" in stage1
    pp2 = {k: torch.tensor(v) for k, v in {**stage0, **stage1}.items()}
    pp1 = {k: torch.tensor(v) for k, v in r0["pp1_weights"].items()}
    assert sorted(pp2) == sorted(pp1)
    assert max((pp2[k] - pp1[k]).abs().max().item() for k in pp1) < 1e-5

    assert r0["pp1_from_pp2_next_id"] == 2
    resumed = {k: torch.tensor(v) for k, v in r0["pp1_from_pp2_weights"].items()}
    assert sorted(resumed) == sorted(pp2)
    assert all(torch.equal(resumed[k], pp2[k]) for k in pp2)
