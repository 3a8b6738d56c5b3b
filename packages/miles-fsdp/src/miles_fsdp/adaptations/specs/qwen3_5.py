"""Qwen3.5 (hybrid Gated-DeltaNet + attention): reset the linear-attention state per document
under THD packing (see :mod:`miles_fsdp.adaptations.document_reset`). The MoE variants also run
their experts on the fused kernels and replay routing (softmax top-k, always renormalised)."""

from miles_fsdp.adaptations.document_reset import install_document_reset
from miles_fsdp.adaptations.moe import register_fused_experts, register_routing_adapter
from miles_fsdp.adaptations.registry import register_packing_patch
from miles_fsdp.adaptations.softmax_topk_replay import patch_softmax_topk_routers

MOE_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")

GATED_DELTA_NET = {"Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"}


@register_packing_patch(("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"))
def reset_gated_delta_net_per_document(model, config) -> None:
    install_document_reset(model, GATED_DELTA_NET)


register_fused_experts(MOE_TYPES)


@register_routing_adapter(MOE_TYPES)
def replay_qwen3_5_moe_routing(model, config, replay) -> int:
    return patch_softmax_topk_routers(model, replay, {"Qwen3_5MoeTopKRouter"})
