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
* megatron-core 0.16.x and 0.19.x, fp32 parameters under ``--bf16`` (``mark_param_dtype``):
  the distributed optimizer's ``model_param_group_index_map`` numbers each group's parameters
  in buffer order, but the inner optimizer's group lists the fp32 shards first and then the
  masters of the 16-bit ones, so every per-parameter state read or written through the map
  (the ``fully_reshardable`` checkpoint) gets another parameter's tensors: a size mismatch at
  save, or silently swapped Adam state. The map is rebuilt in the inner optimizer's order.
* megatron-core 0.19.x: ``dist_checkpointing.save(..., async_sharded_save=True)`` defaults to
  ``async_strategy="nvrx"``, which needs nvidia-resiliency-ext; :func:`async_save_kwargs`
  names megatron-core's own async writer (``"mcore"``, the only one 0.16 has) where the
  argument exists.
"""

from __future__ import annotations

import inspect

from megatron.core import dist_checkpointing
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.transformer.moe import moe_utils


def apply() -> None:
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _fix_step_on_load()
    _fix_group_index_map()


def async_save_kwargs() -> dict:
    """Extra ``dist_checkpointing.save`` arguments of an async save: megatron-core's own writer."""

    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        return {"async_strategy": "mcore"}
    return {}


def _fix_group_index_map() -> None:
    original = DistributedOptimizer.__init__
    if getattr(original, "_miles_index_fix", False):
        return

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        rebuild_group_index_map(self)

    init._miles_index_fix = True
    DistributedOptimizer.__init__ = init


def rebuild_group_index_map(optimizer) -> None:
    """``model_param_group_index_map`` in the order of the inner optimizer's groups: each
    group's fp32 parameters, then its 16-bit ones (``_build_model_and_main_param_groups``)."""
    index = {}
    groups = zip(optimizer.model_fp32_groups, optimizer.model_float16_groups, strict=True)
    for group_index, (fp32_params, float16_params) in enumerate(groups):
        for order, param in enumerate([*fp32_params, *float16_params]):
            index[param] = (group_index, order)
    optimizer.model_param_group_index_map = index


def _fix_step_on_load() -> None:
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
