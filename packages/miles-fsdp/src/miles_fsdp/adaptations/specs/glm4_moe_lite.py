"""GLM-4.7-Flash (glm4_moe_lite): per-expert names at publication, fused expert kernels, routing
replay (sigmoid router with grouped top-k and a score-correction bias; the first
``first_k_dense_replace`` layers are dense and have no router)."""

from miles_fsdp.adaptations.fused_experts import unfuse_experts
from miles_fsdp.adaptations.moe import register_fused_experts, register_routing_adapter
from miles_fsdp.adaptations.registry import register_param_transform
from miles_fsdp.adaptations.sigmoid_group_topk_replay import patch_sigmoid_group_topk_routers

register_param_transform("glm4_moe_lite")(unfuse_experts)
register_fused_experts("glm4_moe_lite")


@register_routing_adapter("glm4_moe_lite")
def replay_glm4_moe_lite_routing(model, config, replay) -> int:
    return patch_sigmoid_group_topk_routers(model, replay, {"Glm4MoeLiteTopkRouter"})
