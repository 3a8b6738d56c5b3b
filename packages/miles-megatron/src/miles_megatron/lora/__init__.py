"""LoRA for the megatron backend: adapters on TP linears, PEFT directories without peft.

See :mod:`miles_megatron.lora.layers` (the layers and their sharding),
:mod:`miles_megatron.lora.adapter_dir` (PEFT directories), :mod:`miles_megatron.lora.weights`
(gather / load / merge) and :mod:`miles_megatron.lora.checkpoint` (adapter-only torch_dist).
"""

from miles_megatron.lora.adapter_dir import (
    AdapterDir,
    AdapterDirError,
    check_matches_flags,
    read_adapter_dir,
    write_adapter_dir,
)
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
    "AdapterDir",
    "AdapterDirError",
    "LoRAAdapter",
    "LoRAConfig",
    "adapters_disabled",
    "check_matches_flags",
    "gather_factors",
    "init_fresh",
    "inject_lora",
    "is_adapter_param",
    "load_factors",
    "lora_adapters",
    "merge_into_hf",
    "read_adapter_dir",
    "write_adapter_dir",
]
