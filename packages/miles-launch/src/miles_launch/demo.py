"""The demo's material, made locally (nothing is downloaded): a tiny Qwen3 and a prompt set.

* **Model**: a Qwen3-architecture causal LM (2 layers, hidden 64) with random weights, saved
  as safetensors with its config and a character-level tokenizer (id 0 is ``<|endoftext|>``,
  then one id per character of :data:`CHARS`); both come from :mod:`miles_launch.tiny_model`.
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

from miles_launch.tiny_model import save_char_tokenizer, tiny_qwen3

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 :"
VOCAB_SIZE = 40  # <|endoftext|> + 38 characters + one filler
TARGET = "0123"


def build_tiny_qwen3(path: str | Path, seed: int = 0) -> Path:
    """Write the demo's random tiny Qwen3 (config, tokenizer, safetensors) to ``path``: 2
    layers, hidden 64 (intermediate 128, head dim 16), vocabulary :data:`VOCAB_SIZE`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_char_tokenizer(path, CHARS, VOCAB_SIZE)
    model = tiny_qwen3(
        seed,
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        head_dim=16,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=0,
    )
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
