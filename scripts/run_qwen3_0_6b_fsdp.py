"""Qwen3-0.6B, FSDP backend, GRPO on math prompts: 4 GPUs train, 4 GPUs generate (1 node).

    python scripts/run_qwen3_0_6b_fsdp.py --hf-checkpoint /models/Qwen3-0.6B \
        --prompt-data /data/dapo-math-17k.jsonl [--dry-run] [more miles train flags]
"""

from miles_launch.recipes import recipe_main

GROUPS = {
    "backend": ["--train-backend", "fsdp"],
    "placement": [
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "4",
        "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "1",
    ],
    "rollout": [
        "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
        "--rm-type", "math", "--num-rollout", "3000", "--rollout-batch-size", "32",
        "--n-samples-per-prompt", "8", "--rollout-max-response-len", "8192",
        "--rollout-temperature", "1.0", "--global-batch-size", "256", "--dynamic-filter",
    ],
    "algorithm": [
        "--advantage-estimator", "grpo", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216",
    ],
    "optimizer": [
        "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.98",
    ],
    "fsdp": ["--gradient-checkpointing"],
    "sglang": ["--sglang-mem-fraction-static", "0.7"],
    "checkpoint": ["--save-interval", "20"],
}  # fmt: skip

if __name__ == "__main__":
    recipe_main(__doc__.split("\n")[0], GROUPS, default_save="/root/Qwen3-0.6B_miles_fsdp")
