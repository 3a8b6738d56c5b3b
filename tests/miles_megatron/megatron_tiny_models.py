"""Test support: tiny HF models of each bridged family, built from a config and saved to disk.

Every parameter (norms and biases included) is drawn at random so that a mapping which drops,
transposes or swaps a tensor changes the logits.
"""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")

COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


def hf_config(family: str, tie: bool = False):
    import transformers

    kwargs = dict(COMMON, tie_word_embeddings=tie)
    if family == "llama":
        return transformers.LlamaConfig(**kwargs, head_dim=16)
    if family == "qwen2":
        return transformers.Qwen2Config(**kwargs)
    if family == "qwen3":
        return transformers.Qwen3Config(**kwargs, head_dim=16)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **kwargs,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    raise ValueError(family)


def make_tiny_hf(family: str, out_dir: str | Path, tie: bool = False, seed: int = 0) -> Path:
    """Save a random tiny ``family`` model (fp32) into ``out_dir``; returns the directory."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, tie), dtype=torch.float32)
    with torch.no_grad():
        for _, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * 0.05 + (1.0 if param.dim() == 1 else 0.0))
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


def hf_logits(hf_dir: str | Path, input_ids: torch.Tensor) -> torch.Tensor:
    """Reference logits ``[batch, seq, vocab]`` of the HF model in fp32 (eager attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits
