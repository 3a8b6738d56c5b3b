"""Tiny Qwen3 models and character-level tokenizers built locally (nothing is downloaded).

The demo's checkpoint and the tests' engines and weight-sync checks all serve these: a
Qwen3-architecture causal LM with random weights (2 layers, 4 query / 2 key-value heads) and a
``tokenizers`` word-level tokenizer whose tokens are single characters.

* Tokenizer: id 0 is :data:`EOS` (also the pad token), then one id per character of ``chars``
  in order, then fillers ``<t{i}>`` up to ``vocab_size``, so every id decodes. Text is split
  into single characters; an unknown character encodes as EOS.
* Model: ``eos_token_id = 0``, untied embeddings. With
  ``weight_scale = s`` every 2-D weight (embeddings, projections, head) is multiplied by ``s``
  after the seeded init; ``s = 8`` turns the 0.02-std init into logits sharp enough that
  greedy decoding has no near-ties, which tests comparing token ids against transformers need.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

EOS = "<|endoftext|>"
DEFAULT_CHARS = "abcdefghijklmnopqrstuvwxyz ,.!?0123456789"


def save_char_tokenizer(path: str | Path, chars: str = DEFAULT_CHARS, vocab_size: int = 64):
    """A character-level ``PreTrainedTokenizerFast`` saved under ``path`` (and returned)."""
    if len(set(chars)) != len(chars) or len(chars) + 1 > vocab_size:
        raise ValueError(
            f"tokenizer: {len(chars)} characters (distinct ones required) do not fit "
            f"vocab_size {vocab_size} with EOS"
        )
    vocab = {EOS: 0}
    for ch in chars:
        vocab[ch] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"<t{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    fast.save_pretrained(path)
    return fast


def sharpen(model, weight_scale: float, min_dim: int = 2):
    """Multiply every parameter with ``dim >= min_dim`` by ``weight_scale`` in place."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= min_dim:
                p.mul_(weight_scale)
    return model


def tiny_qwen3(
    seed: int = 0,
    *,
    vocab_size: int = 64,
    hidden_size: int = 32,
    intermediate_size: int = 64,
    head_dim: int = 8,
    num_hidden_layers: int = 2,
    max_position_embeddings: int = 512,
    weight_scale: float = 1.0,
    **config_overrides,
):
    """A fp32 ``Qwen3ForCausalLM`` in eval mode, initialised under ``torch.manual_seed(seed)``.

    ``config_overrides`` go to ``Qwen3Config`` as they are (e.g. ``pad_token_id=0``, which
    also zeroes that embedding row at init)."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=0,
        tie_word_embeddings=False,
        dtype="float32",
        **config_overrides,
    )
    model = Qwen3ForCausalLM(config)
    if weight_scale != 1.0:
        sharpen(model, weight_scale, min_dim=2)
    return model.eval()
