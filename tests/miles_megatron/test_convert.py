"""Converter: HF -> torch_dist (TP=2) -> HF (TP=1) reproduces every HF tensor bit for bit."""

from __future__ import annotations

import pytest
import torch
from dist_ranks import spawn_ranks
from megatron_ranks import convert_both_ways
from megatron_tiny_models import make_tiny_hf
from miles_core.checkpoint_layout import read_tracker
from safetensors.torch import load_file


@pytest.mark.slow
def test_hf_to_torch_dist_to_hf_bit_exact(tmp_path):
    hf_dir = make_tiny_hf("qwen3_moe", tmp_path / "hf")
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    spawn_ranks(convert_both_ways, 2, str(hf_dir), str(ckpt), str(out), timeout=400)
    assert read_tracker(ckpt) == 0
    original = load_file(hf_dir / "model.safetensors")
    converted = load_file(out / "model.safetensors")
    assert sorted(converted) == sorted(original)
    assert {t.dtype for t in original.values()} == {torch.float32}
    assert all(converted[k].dtype == torch.float32 for k in original)
    assert all(torch.equal(converted[k], original[k]) for k in original)
    assert (out / "config.json").read_text() == (hf_dir / "config.json").read_text()
