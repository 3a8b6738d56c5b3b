"""GLM-4.7-Flash (glm4_moe_lite): publish routed experts under per-expert checkpoint names."""

from miles_fsdp.adaptations.fused_experts import unfuse_experts
from miles_fsdp.adaptations.registry import register_param_transform

register_param_transform("glm4_moe_lite")(unfuse_experts)
