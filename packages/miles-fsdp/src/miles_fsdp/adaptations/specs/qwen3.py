"""Qwen3 (dense): RMSNorm rounded once.

transformers' ``Qwen3RMSNorm`` normalises in fp32, rounds to the compute dtype, then multiplies
by the (bf16) weight and rounds again. Fused RMSNorm kernels of inference engines keep the whole
``x * rsqrt(mean(x^2) + eps) * w`` in fp32 and round once. The patch does the same, so under bf16
the trainer's log-probs sit closer to the rollout engine's (less train/rollout mismatch in the
importance ratios); in fp32 the result is unchanged. The layout of the module (its ``weight``
parameter and ``variance_epsilon``) is untouched, so loading and publication are unaffected.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from miles_fsdp.adaptations.registry import register_model_instance_patch

NORM_CLASSES = {"Qwen3RMSNorm"}


def rms_norm_rounded_once(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``(x * rsqrt(mean(x^2) + eps) * w)`` computed in fp32, cast to the input dtype once."""
    input_dtype = hidden_states.dtype
    x = hidden_states.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return (x * self.weight.float()).to(input_dtype)


@register_model_instance_patch("qwen3")
def round_rms_norm_once(model: nn.Module, config) -> None:
    for module in model.modules():
        if type(module).__name__ in NORM_CLASSES:
            module.forward = types.MethodType(rms_norm_rounded_once, module)
