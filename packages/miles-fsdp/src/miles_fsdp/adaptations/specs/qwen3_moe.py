"""Qwen3-MoE: publish experts under the per-expert names of the released checkpoints."""

from miles_fsdp.adaptations.fused_experts import unfuse_experts
from miles_fsdp.adaptations.registry import register_param_transform

register_param_transform("qwen3_moe")(unfuse_experts)
