"""torch_dist checkpoints are parallelism-agnostic: save at TP=2, reload at TP=1 (fresh model)."""

from __future__ import annotations

import pytest
import torch
from dist_ranks import spawn_ranks
from megatron_ranks import layout_argv, save_then_reload
from megatron_tiny_models import make_tiny_hf


@pytest.mark.slow
def test_save_tp2_load_tp1(tmp_path):
    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(5))
    results = spawn_ranks(
        save_then_reload,
        2,
        hf_dir,
        str(tmp_path / "ckpt"),
        layout_argv(tp=2),
        layout_argv(tp=1),
        ids,
        timeout=300,
    )
    assert any(p.suffix == ".distcp" for p in (tmp_path / "ckpt").iterdir())
    for r in results:
        assert r["random_diff"] > 1e-2  # the fresh model really started elsewhere
        assert r["reload_diff"] < 1e-5
