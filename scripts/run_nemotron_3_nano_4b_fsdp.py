"""Nemotron-3-Nano-4B (hybrid Mamba2), FSDP backend, GRPO on math: 4 + 4 GPUs on 1 node.

    python scripts/run_nemotron_3_nano_4b_fsdp.py --hf-checkpoint /models/Nemotron-3-Nano-4B \
        --prompt-data /data/dapo-math-17k.jsonl [--dry-run] [more miles train flags]
"""

from miles_launch.recipes import fsdp_math_grpo_groups, recipe_main

GROUPS = fsdp_math_grpo_groups(
    placement=[
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "4",
        "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "1",
    ],
    sglang=["--sglang-mem-fraction-static", "0.7", "--sglang-trust-remote-code"],
    dynamic_filter=False,
)  # fmt: skip

if __name__ == "__main__":
    recipe_main(__doc__.split("\n")[0], GROUPS, default_save="/root/Nemotron-3-Nano-4B_miles_fsdp")
