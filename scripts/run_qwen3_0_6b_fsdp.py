"""Qwen3-0.6B, FSDP backend, GRPO on math prompts: 4 GPUs train, 4 GPUs generate (1 node).

    python scripts/run_qwen3_0_6b_fsdp.py --hf-checkpoint /models/Qwen3-0.6B \
        --prompt-data /data/dapo-math-17k.jsonl [--dry-run] [more miles train flags]
"""

from miles_launch.recipes import fsdp_math_grpo_groups, recipe_main

GROUPS = fsdp_math_grpo_groups(
    placement=[
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "4",
        "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "1",
    ],
    sglang=["--sglang-mem-fraction-static", "0.7"],
    max_tokens_per_gpu=9216,
)  # fmt: skip

if __name__ == "__main__":
    recipe_main(__doc__.split("\n")[0], GROUPS, default_save="/root/Qwen3-0.6B_miles_fsdp")
