"""Test support of the memory plan's tests (test_memory_estimate.py, test_memory_plan.py): small
Qwen3 and Qwen3-MoE configs, and the shape a run reads back from a saved config.json."""

from __future__ import annotations

from pathlib import Path

from miles_launch.model_shape import ModelShape

SMALL = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def configs():
    from transformers import Qwen3Config, Qwen3MoeConfig

    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    return {
        "qwen3-tied": Qwen3Config(**SMALL, head_dim=16, tie_word_embeddings=True),
        "qwen3-untied": Qwen3Config(**SMALL, tie_word_embeddings=False),
        "qwen3-moe": Qwen3MoeConfig(**SMALL, **moe, mlp_only_layers=[0]),
        "qwen3-moe-tied": Qwen3MoeConfig(**SMALL, **moe, tie_word_embeddings=True),
    }


def saved_shape(config, tmp_path: Path) -> ModelShape:
    """The shape read back from the config.json ``save_pretrained`` writes (what a run reads)."""
    config.save_pretrained(tmp_path)
    return ModelShape.from_hf_dir(tmp_path)
