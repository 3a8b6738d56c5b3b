"""The memory plan's per-layer activation bytes (miles_launch.model_shape, ``layers="megatron"``)
against what megatron-core's local Qwen3 layer saves through the Megatron backend in one
micro-batch: the difference between a 4-layer and a 2-layer model, per layer per token, less the
sdpa path's ``T x T`` bf16 mask (a GPU's varlen path has none), within 2% (HF's layers are held
to theirs in tests/miles_launch/test_memory_estimate.py). Twice: with the CPU's RMSNorm (torch's
fp32 decomposition) and with RMSNorm as a GPU runs it (torch's ``_fused_rms_norm`` autograd node,
memory_plan_ranks.use_fused_rms_norm), which the plan counts on a GPU."""

from __future__ import annotations

import pytest

TOKENS, SAMPLES = 256, 1


@pytest.mark.extended
def test_megatron_layer_saves_what_the_plan_counts(tmp_path):
    import torch
    from dist_ranks import spawn_ranks
    from memory_plan_ranks import saved_bytes
    from miles_launch.model_shape import ModelShape
    from transformers import AutoModelForCausalLM, Qwen3Config

    totals = {}
    for layers in (2, 4):
        config = Qwen3Config(
            vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
        )  # fmt: skip
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # as released
        model.save_pretrained(tmp_path / str(layers))
        (result,) = spawn_ranks(saved_bytes, 1, str(tmp_path / str(layers)), TOKENS, SAMPLES)
        totals[layers] = result
    mask = 2 * TOKENS  # bytes per token of the [T, T] bf16 mask
    shape = ModelShape.from_config(config.to_dict())
    for index, fused_norm in enumerate((False, True)):
        measured = (totals[4][index] - totals[2][index]) / 2 / TOKENS / SAMPLES - mask
        counted = shape.layer_activation_bytes(False, 2, layers="megatron", fused_norm=fused_norm)
        assert counted == pytest.approx(measured, rel=0.02), fused_norm
        # the two norms differ by more than the tolerance: the pass tells them apart
        other = shape.layer_activation_bytes(False, 2, "megatron", fused_norm=not fused_norm)
        assert other != pytest.approx(measured, rel=0.1), fused_norm
