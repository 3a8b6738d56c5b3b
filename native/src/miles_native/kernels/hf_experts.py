"""transformers' batched MoE experts through :func:`fused_experts`.

transformers 5.x stores the experts of ``qwen3_moe``, ``qwen3_5_moe``, ``glm4_moe_lite`` (and
``glm4_moe``, ``deepseek_v3``, ``qwen2_moe``, ``mixtral``) as one module with 3-D weights
``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` whose forward is chosen by
``config._experts_implementation`` through ``transformers.integrations.moe.ExpertsInterface``.
This module registers the fused kernels there as ``"miles_fused"``::

    from miles_native.kernels.hf_experts import use_fused_experts
    use_fused_experts(model)          # every experts module of the model now runs the kernels
    model.set_experts_implementation("eager")   # back to transformers' loop

The router, shared experts and the model's own code are untouched; only the per-expert loop
is replaced, so gradients reach the router through the routing weights as before.
transformers is imported lazily: miles-native does not depend on it.
"""

import torch

from miles_native.kernels.fused_moe import fused_experts

EXPERTS_IMPLEMENTATION = "miles_fused"
_SILU = ("silu", "swish")


def _check_supported(experts: torch.nn.Module) -> None:
    unsupported = [
        flag
        for flag, bad in (
            ("has_bias", getattr(experts, "has_bias", False)),
            ("is_transposed", getattr(experts, "is_transposed", False)),
            ("is_concatenated=False", not getattr(experts, "is_concatenated", True)),
            ("has_gate=False", not getattr(experts, "has_gate", True)),
            ("has_post_expert_norm", getattr(experts, "has_post_expert_norm", False)),
            ("expert parallel", getattr(experts, "_is_expert_parallel", False)),
        )
        if bad
    ]
    act = getattr(getattr(experts, "config", None), "hidden_act", "silu")
    if act not in _SILU:
        unsupported.append(f"hidden_act={act!r}")
    if unsupported:
        raise NotImplementedError(
            f"experts implementation {EXPERTS_IMPLEMENTATION!r} supports concatenated, "
            f"untransposed, bias-free SiLU experts; {type(experts).__name__} has "
            + ", ".join(unsupported)
        )


def fused_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The experts forward of transformers (``[T, H]`` in, ``[T, H]`` out) on the fused kernels."""
    _check_supported(self)
    return fused_experts(
        hidden_states, self.gate_up_proj, self.down_proj, top_k_index, top_k_weights
    )


def register_fused_experts() -> None:
    """Make ``experts_implementation="miles_fused"`` known to transformers (idempotent)."""
    # optional: transformers is not a miles-native dependency
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, fused_experts_forward)


def use_fused_experts(model: torch.nn.Module) -> None:
    """Switch every batched-experts module of a transformers model to the fused kernels."""
    register_fused_experts()
    model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
