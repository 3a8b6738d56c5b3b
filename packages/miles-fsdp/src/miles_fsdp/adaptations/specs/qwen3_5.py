"""Qwen3.5 (hybrid Gated-DeltaNet + attention): reset the linear-attention state per document
under THD packing (see :mod:`miles_fsdp.adaptations.document_reset`)."""

from miles_fsdp.adaptations.document_reset import install_document_reset
from miles_fsdp.adaptations.registry import register_packing_patch

GATED_DELTA_NET = {"Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"}


@register_packing_patch(("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"))
def reset_gated_delta_net_per_document(model, config) -> None:
    install_document_reset(model, GATED_DELTA_NET)
