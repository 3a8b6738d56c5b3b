"""Qwen3-30B-A3B (MoE), FSDP backend, GRPO on math: 2 nodes train, 1 node generates (TP 8).

    python scripts/run_qwen3_30b_a3b_fsdp.py --hf-checkpoint /models/Qwen3-30B-A3B \
        --prompt-data /data/dapo-math-17k.jsonl [--dry-run] [more miles train flags]
"""

from miles_launch.recipes import fsdp_math_grpo_groups, recipe_main

GROUPS = fsdp_math_grpo_groups(
    placement=[
        "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "8",
        "--rollout-num-gpus", "8", "--rollout-num-gpus-per-engine", "8",
    ],
    sglang=[
        "--sglang-mem-fraction-static", "0.7", "--sglang-ep-size", "8",
        "--sglang-cuda-graph-bs-decode", "1", "2", "4", "8", "16", "32", "64",
    ],
)  # fmt: skip

if __name__ == "__main__":
    recipe_main(__doc__.split("\n")[0], GROUPS, default_save="/root/Qwen3-30B-A3B_miles_fsdp")
