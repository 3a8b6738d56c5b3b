"""Qwen3-30B-A3B (MoE), FSDP backend, GRPO on math: 2 nodes train, 1 node generates (TP 8).

    python scripts/run_qwen3_30b_a3b_fsdp.py --hf-checkpoint /models/Qwen3-30B-A3B \
        --prompt-data /data/dapo-math-17k.jsonl [--dry-run] [more miles train flags]
"""

from miles_launch.recipes import recipe_main

GROUPS = {
    "backend": ["--train-backend", "fsdp"],
    "placement": [
        "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "8",
        "--rollout-num-gpus", "8", "--rollout-num-gpus-per-engine", "8",
    ],
    "rollout": [
        "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
        "--rm-type", "math", "--num-rollout", "3000", "--rollout-batch-size", "32",
        "--n-samples-per-prompt", "8", "--rollout-max-response-len", "8192",
        "--rollout-temperature", "1.0", "--global-batch-size", "256", "--dynamic-filter",
    ],
    "algorithm": [
        "--advantage-estimator", "grpo", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "8192",
    ],
    "optimizer": [
        "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.98",
    ],
    "fsdp": ["--gradient-checkpointing"],
    "sglang": [
        "--sglang-mem-fraction-static", "0.7", "--sglang-enable-ep-moe",
        "--sglang-cuda-graph-bs", "1", "2", "4", "8", "16", "32", "64",
    ],
    "checkpoint": ["--save-interval", "20"],
}  # fmt: skip

if __name__ == "__main__":
    recipe_main(__doc__.split("\n")[0], GROUPS, default_save="/root/Qwen3-30B-A3B_miles_fsdp")
