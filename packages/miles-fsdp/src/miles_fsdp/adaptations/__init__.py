"""Per-architecture adaptations of HF models for FSDP training (see :mod:`.registry`)."""

from miles_fsdp.adaptations.registry import (
    Adaptation,
    adaptation_for,
    apply_param_transforms,
    register_model_instance_patch,
    register_model_patch,
    register_packing_patch,
    register_param_transform,
    register_post_load_fixup,
    register_precision_policy,
    registered_model_types,
)

__all__ = [
    "Adaptation",
    "adaptation_for",
    "apply_param_transforms",
    "register_model_instance_patch",
    "register_model_patch",
    "register_packing_patch",
    "register_param_transform",
    "register_post_load_fixup",
    "register_precision_policy",
    "registered_model_types",
]
