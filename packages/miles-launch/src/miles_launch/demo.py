"""The demo's material, made locally (nothing is downloaded): a tiny Qwen3 and a prompt set.

* **Model**: a Qwen3-architecture causal LM (2 layers, hidden 64) with random weights, saved
  as safetensors with its config and a character-level tokenizer built with ``tokenizers``
  (id 0 is ``<|endoftext|>``, then one id per character of :data:`CHARS`).
* **Task**: every prompt is ``"digits please: <letters>"`` with the label ``"0123"``; the
  reward (``--rm-type label-char-fraction``) is the share of the ``--rollout-max-response-len``
  positions filled with one of those characters. A random model scores about 4/40 = 0.1;
  the best response (all target characters, no early EOS) scores 1. The policy only has to
  shift probability onto four tokens and away from EOS, which a tiny model learns in a few
  rollouts.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 :"
VOCAB_SIZE = 40  # <|endoftext|> + 38 characters + one filler
TARGET = "0123"


def save_char_tokenizer(path: str | Path):
    """A character-level fast tokenizer saved under ``path`` (and returned)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    while len(vocab) < VOCAB_SIZE:
        vocab[f"<t{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.save_pretrained(path)
    return fast


def build_tiny_qwen3(path: str | Path, seed: int = 0) -> Path:
    """Write a random tiny Qwen3 checkpoint (config, tokenizer, safetensors) to ``path``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_char_tokenizer(path)
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        eos_token_id=0,
        pad_token_id=0,
        bos_token_id=0,
        tie_word_embeddings=False,
        dtype="float32",
    )
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    return path


def write_demo_prompts(path: str | Path, num_prompts: int = 64, seed: int = 0) -> Path:
    """``num_prompts`` lines ``{"prompt": "digits please: <letters>", "label": "0123"}``."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    path = Path(path)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(num_prompts):
            tail = "".join(rng.choice(letters) for _ in range(4))
            f.write(json.dumps({"prompt": f"digits please: {tail}", "label": TARGET}) + "\n")
    return path


def demo_flags(hf_dir: str | Path, prompts: str | Path, metrics: str | Path) -> list[str]:
    """The ``miles train`` flags of the demo (2 gloo trainer ranks, 1 built-in CPU engine)."""
    return [
        "--train-backend", "fsdp",
        "--hf-checkpoint", str(hf_dir),
        "--prompt-data", str(prompts),
        "--input-key", "prompt",
        "--label-key", "label",
        "--rm-type", "label-char-fraction",
        "--rollout-engine", "builtin",
        "--actor-num-nodes", "1",
        "--actor-num-gpus-per-node", "2",
        "--rollout-num-gpus", "1",
        "--num-rollout", "12",
        "--rollout-batch-size", "8",
        "--n-samples-per-prompt", "8",
        "--rollout-max-response-len", "8",
        "--rollout-temperature", "1.0",
        "--advantage-estimator", "grpo",
        "--num-steps-per-rollout", "2",
        "--lr", "1e-2",
        "--weight-decay", "0.0",
        "--clip-grad", "1.0",
        "--fsdp-compute-dtype", "fp32",
        "--attn-implementation", "sdpa",
        "--metrics-jsonl", str(metrics),
    ]  # fmt: skip
