"""Tiny HF models written to disk with save_pretrained, plus a word-level tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch


def save_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level fast tokenizer with ``vocab_size`` entries, saved into ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1} | {f"w{i}": i for i in range(2, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(str(path))


def qwen3_config(**overrides):
    from transformers import Qwen3Config

    kwargs = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


def save_tiny_model(path: Path, config=None, seed: int = 0, dtype=torch.float32) -> Path:
    """Build a randomly initialised causal LM from ``config`` and ``save_pretrained`` it."""
    from transformers import AutoModelForCausalLM

    config = config if config is not None else qwen3_config()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(str(path))
    save_tokenizer(path, config.vocab_size)
    return path


def arch_config(model_type: str):
    """Tiny configs of the architectures with adaptation specs."""
    from transformers import AutoConfig

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, tie_word_embeddings=False)
    kwargs = {
        "qwen3_moe": dict(
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
        ),
        "glm4_moe_lite": dict(
            moe_intermediate_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            num_hidden_layers=2,
            first_k_dense_replace=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            n_group=1,
            topk_group=1,
        ),
        "qwen3_5_text": dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            layer_types=["linear_attention", "full_attention"],
            linear_num_value_heads=2,
            linear_num_key_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
        ),
        "qwen3_5_moe_text": dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            layer_types=["linear_attention", "full_attention"],
            linear_num_value_heads=2,
            linear_num_key_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            shared_expert_intermediate_size=16,
        ),
        "nemotron_h": dict(
            num_hidden_layers=4,
            hybrid_override_pattern="M*-E",
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            mamba_num_heads=4,
            mamba_head_dim=8,
            ssm_state_size=8,
            n_groups=1,
            mamba_d_conv=4,
            chunk_size=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=16,
            n_group=1,
            topk_group=1,
        ),
    }[model_type]
    return AutoConfig.for_model(model_type, **(common | kwargs))


#: A vision tower small enough to save in milliseconds (the causal LM does not load it).
TINY_VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=32,
    patch_size=2,
    temporal_patch_size=1,
    spatial_merge_size=1,
)


def save_multimodal_qwen3_5(path: Path, moe: bool, seed: int = 0) -> Path:
    """A Qwen3.5 checkpoint as released: the image-text model (``model.language_model.*``,
    ``model.visual.*``, ``lm_head``) with a tiny text config, ``save_pretrained`` into ``path``."""
    import transformers
    from transformers import AutoConfig

    text = arch_config("qwen3_5_moe_text" if moe else "qwen3_5_text").to_dict()
    model_type = "qwen3_5_moe" if moe else "qwen3_5"
    config = AutoConfig.for_model(
        model_type, text_config=text, vision_config=TINY_VISION, tie_word_embeddings=False
    )
    cls = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
    torch.manual_seed(seed)
    getattr(transformers, cls)(config).save_pretrained(str(path))
    save_tokenizer(path, text["vocab_size"])
    return path
