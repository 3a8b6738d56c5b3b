"""Triton kernels of miles (pure Triton, no sglang): the fused MoE expert layer.

Importing this package compiles nothing; kernels are JIT-compiled on first use. On a machine
without a GPU they run under Triton's interpreter when ``TRITON_INTERPRET=1`` is set before the
first import (that is how the CPU tests run them).
"""

from miles_native.kernels.fused_moe import FusedExpertsFunction, fused_experts
from miles_native.kernels.fused_moe_configs import (
    FusedMoEConfig,
    GemmConfig,
    WeightGradConfig,
    default_config,
    get_config,
)
from miles_native.kernels.moe_align import MoEAlignment, align_by_expert

__all__ = [
    "FusedExpertsFunction",
    "FusedMoEConfig",
    "GemmConfig",
    "MoEAlignment",
    "WeightGradConfig",
    "align_by_expert",
    "default_config",
    "fused_experts",
    "get_config",
]
