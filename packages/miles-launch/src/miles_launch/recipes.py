"""Model recipes: the ``miles train`` command of a tuned job, with local paths filled in.

A recipe script (``scripts/run_<model>_fsdp.py``) holds the model's flags grouped as in the
seeds' launch scripts (placement, rollout, algorithm, optimizer, engine, checkpoint), most of
them from :func:`fsdp_math_grpo_groups`, and calls :func:`recipe_main`, which adds ``--hf-checkpoint``, ``--prompt-data`` and ``--save`` from its
own command line, appends any further flags (they win, being later), and either prints the
full command (``--dry-run``) or runs it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence


def fsdp_math_grpo_groups(
    placement: Sequence[str],
    sglang: Sequence[str],
    max_tokens_per_gpu: int = 8192,
    dynamic_filter: bool = True,
) -> dict[str, list[str]]:
    """The flag groups of the FSDP GRPO-on-math recipes; only placement, the SGLang flags, the
    per-GPU token budget and dynamic filtering differ between models.

    GRPO with an asymmetric clip (0.2 / 0.28), dynamic batch size, 8 samples of up to 8192
    tokens per prompt, 32 prompts per rollout, global batch 256, constant lr 1e-6 (AdamW, beta2
    0.98, weight decay 0.1), gradient checkpointing, a checkpoint every 20 rollouts.
    """
    return {
        "backend": ["--train-backend", "fsdp"],
        "placement": list(placement),
        "rollout": [
            "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
            "--rm-type", "math", "--num-rollout", "3000", "--rollout-batch-size", "32",
            "--n-samples-per-prompt", "8", "--rollout-max-response-len", "8192",
            "--rollout-temperature", "1.0", "--global-batch-size", "256",
        ] + (["--dynamic-filter"] if dynamic_filter else []),
        "algorithm": [
            "--advantage-estimator", "grpo", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
            "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(max_tokens_per_gpu),
        ],
        "optimizer": [
            "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
            "--adam-beta1", "0.9", "--adam-beta2", "0.98",
        ],
        "fsdp": ["--gradient-checkpointing"],
        # the recipes are SGLang jobs: said explicitly, so a machine without sglang installed
        # does not quietly pick the built-in engine (one device per engine)
        "sglang": ["--rollout-engine", "sglang", *sglang],
        "checkpoint": ["--save-interval", "20"],
    }  # fmt: skip


def recipe_command(
    groups: dict[str, Sequence[str]],
    hf_checkpoint: str,
    prompt_data: str,
    save: str,
    extra: Sequence[str] = (),
) -> list[str]:
    """``miles train`` followed by every group's flags, the paths and ``extra``."""
    cmd = ["miles", "train"]
    for flags in groups.values():
        cmd += list(flags)
    cmd += ["--hf-checkpoint", hf_checkpoint, "--prompt-data", prompt_data, "--save", save]
    return cmd + list(extra)


def recipe_main(description: str, groups: dict[str, Sequence[str]], default_save: str) -> None:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--hf-checkpoint", required=True, help="local HF model directory")
    parser.add_argument(
        "--prompt-data", required=True, help="JSONL prompts with 'prompt' and 'label' keys"
    )
    parser.add_argument("--save", default=default_save, help="checkpoint directory")
    parser.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    ours, extra = parser.parse_known_args()
    cmd = recipe_command(groups, ours.hf_checkpoint, ours.prompt_data, ours.save, extra)
    if ours.dry_run:
        print(shlex.join(cmd))
        return
    print("$ " + shlex.join(cmd), flush=True)
    argv = [sys.executable, "-m", "miles_launch.train", *cmd[2:]]
    os.execv(sys.executable, argv)
