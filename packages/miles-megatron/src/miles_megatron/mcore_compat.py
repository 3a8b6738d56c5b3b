"""Compatibility fixes for megatron-core releases this package supports (0.16 - 0.19).

Each fix is applied by :func:`apply` (idempotent), only where the installed release needs it.

* megatron-core 0.16.x without TransformerEngine: ``moe_utils.RouterGatingLinearFunction``
  reads the module global ``te_general_gemm``, which is only bound when TransformerEngine
  imports, so every MoE router forward raises ``NameError``. Binding it to ``None`` selects the
  plain ``torch`` matmul path the function already has.
* megatron-core 0.16.x with torch's Adam (no TransformerEngine/Apex): loading a
  ``fully_reshardable`` distributed-optimizer checkpoint copies every key of the live Adam
  state from the loaded tensors, but torch's state also holds ``step``, which the checkpoint
  keeps in its param groups (restored by ``load_state_dict`` itself) and not per tensor:
  ``KeyError: 'step'``. The wrapper lets such a state keep its already restored ``step``.
"""

from __future__ import annotations


def apply() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_miles_step_fix", False):
        return

    def set_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state[main_param].get("step")
            if step is not None:
                tensors = {**tensors, "step": step.clone()}
        return original(self, model_param, tensors)

    set_states._miles_step_fix = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states
