"""LoRA for the megatron backend: adapters on TP linears, exchanged as PEFT directories.

See :mod:`miles_megatron.lora.layers` (the layers and their sharding),
:mod:`miles_megatron.lora.weights` (gather / load / merge) and
:mod:`miles_megatron.lora.checkpoint` (adapter-only torch_dist). PEFT directories are read and
written by :mod:`miles_core.peft_adapter` (shared with the FSDP backend; no peft import).
"""

from miles_megatron.lora.layers import (
    LoRAAdapter,
    LoRAConfig,
    adapters_disabled,
    init_fresh,
    inject_lora,
    is_adapter_param,
    lora_adapters,
)
from miles_megatron.lora.weights import gather_factors, load_factors, merge_into_hf

__all__ = [
    "LoRAAdapter",
    "LoRAConfig",
    "adapters_disabled",
    "gather_factors",
    "init_fresh",
    "inject_lora",
    "is_adapter_param",
    "load_factors",
    "lora_adapters",
    "merge_into_hf",
]
