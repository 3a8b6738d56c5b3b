"""Qwen3.5 (hybrid Gated-DeltaNet + attention), dense and MoE.

* Packing: reset the linear-attention state per document under THD packing (see
  :mod:`miles_fsdp.adaptations.document_reset`).
* MoE variants: experts on the fused kernels, routing replay (softmax top-k, always
  renormalised), and per-expert names at publication (released checkpoints keep experts per
  expert; transformers fuses them at load).
* Multimodal checkpoints (``model_type`` ``qwen3_5`` / ``qwen3_5_moe``, a ``text_config``
  inside): the causal LM loads the language model's ``model.language_model.*`` weights as
  ``model.*`` (the vision tower is not loaded); weights go back out under the checkpoint's
  ``model.language_model.*`` names. Text-only checkpoints (``*_text``) keep ``model.*``.
"""

from miles_fsdp.adaptations.document_reset import install_document_reset
from miles_fsdp.adaptations.fused_experts import unfuse_experts
from miles_fsdp.adaptations.moe import register_fused_experts, register_routing_adapter
from miles_fsdp.adaptations.registry import register_packing_patch, register_param_transform
from miles_fsdp.adaptations.renames import prefix_rename
from miles_fsdp.adaptations.softmax_topk_replay import patch_softmax_topk_routers

MOE_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
MULTIMODAL_TYPES = ("qwen3_5", "qwen3_5_moe")

GATED_DELTA_NET = {"Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"}


@register_packing_patch(("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"))
def reset_gated_delta_net_per_document(model, config) -> None:
    install_document_reset(model, GATED_DELTA_NET)


register_fused_experts(MOE_TYPES)
register_param_transform(MOE_TYPES)(unfuse_experts)
register_param_transform(MULTIMODAL_TYPES)(prefix_rename("model.", "model.language_model."))


@register_routing_adapter(MOE_TYPES)
def replay_qwen3_5_moe_routing(model, config, replay) -> int:
    return patch_softmax_topk_routers(model, replay, {"Qwen3_5MoeTopKRouter"})
