"""Qwen3-0.6B, GRPO on math prompts, on either training backend: one recipe, 4 GPUs train
(megatron: TP 2 x DP 2; FSDP: DP 4), 4 GPUs generate (1 node).

    python scripts/run_mcore_fsdp.py --train-backend megatron|fsdp \
        --hf-checkpoint /models/Qwen3-0.6B --prompt-data /data/dapo-math-17k.jsonl \
        [--dry-run] [more miles train flags]

Everything but the backend's own group is shared, so the two runs are comparable step for step;
the megatron backend derives its architecture flags from the HF config (its bridge).
"""

import argparse
import sys

from miles_launch.recipes import recipe_main

SHARED = {
    "placement": [
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "4",
        "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "1",
    ],
    "rollout": [
        "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
        "--rm-type", "math", "--num-rollout", "3000", "--rollout-batch-size", "32",
        "--n-samples-per-prompt", "8", "--rollout-max-response-len", "8192",
        "--rollout-temperature", "1.0", "--global-batch-size", "256",
    ],
    "algorithm": [
        "--advantage-estimator", "grpo", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216",
    ],
    "optimizer": [
        "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--bf16",
    ],
    "sglang": ["--rollout-engine", "sglang", "--sglang-mem-fraction-static", "0.7"],
    "checkpoint": ["--save-interval", "20"],
}  # fmt: skip

BACKENDS = {
    "megatron": [
        "--train-backend", "megatron",
        "--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1",
    ],
    "fsdp": ["--train-backend", "fsdp", "--gradient-checkpointing"],
}  # fmt: skip


def groups(backend: str) -> dict[str, list[str]]:
    """The recipe's flag groups for ``backend`` (``megatron`` or ``fsdp``), backend first."""
    return {"backend": BACKENDS[backend], **SHARED}


def main(argv: list[str] | None = None) -> None:
    pick = argparse.ArgumentParser(add_help=False)
    pick.add_argument("--train-backend", choices=sorted(BACKENDS), default="megatron")
    ours, rest = pick.parse_known_args(sys.argv[1:] if argv is None else argv)
    sys.argv = [sys.argv[0], *rest]  # recipe_main reads the remaining flags
    recipe_main(
        __doc__.split("\n")[0] + " (--train-backend megatron|fsdp)",
        groups(ours.train_backend),
        default_save=f"/root/Qwen3-0.6B_miles_{ours.train_backend}",
    )


if __name__ == "__main__":
    main()
