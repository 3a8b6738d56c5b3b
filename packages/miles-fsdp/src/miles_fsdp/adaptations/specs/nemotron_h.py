"""Nemotron-H (Mamba2 hybrid).

* Packing: reset the Mamba2 mixers' convolution and SSM state per document.
* Publication: released checkpoints name the trunk ``backbone.*`` (transformers renames it to
  ``model.*`` at load) and keep MoE experts per expert; weights go back out under those names.
"""

from miles_fsdp.adaptations.document_reset import install_document_reset
from miles_fsdp.adaptations.fused_experts import unfuse_experts
from miles_fsdp.adaptations.registry import register_packing_patch, register_param_transform
from miles_fsdp.adaptations.renames import prefix_rename


@register_packing_patch("nemotron_h")
def reset_mamba_per_document(model, config) -> None:
    install_document_reset(model, {"NemotronHMamba2Mixer"})


register_param_transform("nemotron_h")(prefix_rename("model.", "backbone."))
register_param_transform("nemotron_h")(unfuse_experts)
