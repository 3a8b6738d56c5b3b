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
