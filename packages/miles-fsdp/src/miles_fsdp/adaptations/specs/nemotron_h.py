"""Nemotron-H (Mamba2 hybrid).

* Packing: reset the Mamba2 mixers' convolution and SSM state per document.
* Publication: released checkpoints name the trunk ``backbone.*`` (transformers renames it to
  ``model.*`` at load) and keep MoE experts per expert; weights go back out under those names.
"""

from miles_fsdp.adaptations.document_reset import install_document_reset
from miles_fsdp.adaptations.fused_experts import unfuse_experts
from miles_fsdp.adaptations.registry import register_packing_patch, register_param_transform

MODEL_PREFIX = "model."
CHECKPOINT_PREFIX = "backbone."


@register_packing_patch("nemotron_h")
def reset_mamba_per_document(model, config) -> None:
    install_document_reset(model, {"NemotronHMamba2Mixer"})


@register_param_transform("nemotron_h")
def backbone_names(name, tensor, config):
    if name.startswith(MODEL_PREFIX):
        return [(CHECKPOINT_PREFIX + name[len(MODEL_PREFIX) :], tensor)]
    return None


register_param_transform("nemotron_h")(unfuse_experts)
