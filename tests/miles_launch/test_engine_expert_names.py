"""The built-in engine takes a MoE checkpoint's per-expert tensors into transformers' batched
expert parameters (what the trainers publish, and what ``save_pretrained`` writes)."""

from __future__ import annotations

import pytest
import torch
from engine_testing import tiny_qwen3_moe
from miles_launch.builtin_engine.weights import WeightStore
from safetensors import safe_open


def test_per_expert_checkpoint_loads_into_batched_experts(tmp_path):
    source = tiny_qwen3_moe(0)
    source.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in names  # per expert on disk
    assert not any(n.endswith("gate_up_proj") for n in names)

    served = tiny_qwen3_moe(1)
    store = WeightStore(served, torch.device("cpu"))
    assert store.load_from_disk(str(tmp_path)) == len(names)
    want = source.state_dict()  # transformers' own merge of the same checkpoint
    for name, tensor in served.state_dict().items():
        assert torch.equal(tensor, want[name]), name


def test_unknown_expert_is_refused_by_name():
    store = WeightStore(tiny_qwen3_moe(0), torch.device("cpu"))
    bad = "model.layers.1.mlp.experts.8.down_proj.weight"  # 8 experts: 0..7
    with pytest.raises(ValueError, match="experts.8.down_proj"):
        store.load_named([(bad, torch.zeros(32, 16))])
    with pytest.raises(ValueError, match=r"experts.3.up_proj.weight: shape \(16, 16\)"):
        store.load_named([("model.layers.1.mlp.experts.3.up_proj.weight", torch.zeros(16, 16))])
