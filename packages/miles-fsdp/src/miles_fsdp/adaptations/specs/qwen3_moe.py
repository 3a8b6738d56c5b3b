"""Qwen3-MoE: per-expert names at publication, fused expert kernels, routing replay."""

from miles_fsdp.adaptations.fused_experts import unfuse_experts
from miles_fsdp.adaptations.moe import register_fused_experts, register_routing_adapter
from miles_fsdp.adaptations.registry import register_param_transform
from miles_fsdp.adaptations.softmax_topk_replay import patch_softmax_topk_routers

register_param_transform("qwen3_moe")(unfuse_experts)
register_fused_experts("qwen3_moe")


@register_routing_adapter("qwen3_moe")
def replay_qwen3_moe_routing(model, config, replay) -> int:
    return patch_softmax_topk_routers(model, replay, {"Qwen3MoeTopKRouter"})
