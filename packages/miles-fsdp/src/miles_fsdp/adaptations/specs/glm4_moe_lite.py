"""GLM-4.7-Flash (glm4_moe_lite): per-expert names at publication, fused expert kernels.

No routing adapter yet: its router is sigmoid with grouped top-k and a score-correction bias.
"""

from miles_fsdp.adaptations.fused_experts import unfuse_experts
from miles_fsdp.adaptations.moe import register_fused_experts
from miles_fsdp.adaptations.registry import register_param_transform

register_param_transform("glm4_moe_lite")(unfuse_experts)
register_fused_experts("glm4_moe_lite")
