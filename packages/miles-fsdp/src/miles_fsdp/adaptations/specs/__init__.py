"""Shipped architecture specs; importing this package registers them all.

This list is the source of truth for which architectures have an adaptation spec.
"""

from miles_fsdp.adaptations.specs import (  # noqa: F401
    glm4_moe_lite,
    nemotron_h,
    qwen3,
    qwen3_5,
    qwen3_moe,
)

SPECS = ("glm4_moe_lite", "nemotron_h", "qwen3", "qwen3_5", "qwen3_moe")
