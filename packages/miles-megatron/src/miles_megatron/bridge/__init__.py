"""HF <-> megatron-core bridge: architecture args from ``config.json`` and weight layouts."""

from miles_megatron.bridge.base import (
    Bridge,
    BridgeError,
    attention_shape,
    load_hf_config,
    padded_vocab_size,
)
from miles_megatron.bridge.registry import bridge_for, register_bridge, registered_model_types
from miles_megatron.bridge.rules import AttentionShape, WeightRule

__all__ = [
    "AttentionShape",
    "Bridge",
    "BridgeError",
    "WeightRule",
    "attention_shape",
    "bridge_for",
    "load_hf_config",
    "padded_vocab_size",
    "register_bridge",
    "registered_model_types",
]
