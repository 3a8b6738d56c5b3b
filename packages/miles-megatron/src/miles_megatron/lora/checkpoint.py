"""Adapter-only torch_dist state: one ``ShardedTensor`` per LoRA factor, parallelism-agnostic.

Keys are ``lora.<global megatron name>`` (``lora.decoder.layers.3.self_attention.linear_qkv.
adapter.lora_B.q_proj``; layer and expert numbers global), split along the factor's TP dim
where it is split (B of column-parallel linears, A of row-parallel ones) and replicated
elsewhere, so a TP=2 save loads at TP=1. The frozen base is not saved: it is rebuilt from
``--hf-checkpoint`` on resume. The distributed optimizer's state is saved against this dict
(only adapters are in the optimizer).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from miles_megatron.lora.layers import LoRAAdapter
from miles_megatron.sharding import global_name, unwrap

PREFIX = "lora."


def _dp_rank(is_expert: bool) -> int:
    if is_expert:
        return ps.get_expert_data_parallel_rank()
    return ps.get_data_parallel_rank(with_context_parallel=True)


def adapter_sharded_state_dict(model: torch.nn.Module, num_experts: int | None) -> dict[str, Any]:
    """``{key: ShardedTensor}`` of this rank's adapter factors (the data are the parameters)."""
    out: dict[str, Any] = {}
    for module_name, module in unwrap(model).named_modules():
        if not isinstance(module, LoRAAdapter):
            continue
        dp_rank = _dp_rank(module.is_expert)
        for factor, split_dim in module.split_dims().items():
            for short, param in getattr(module, factor).items():
                key = PREFIX + global_name(f"{module_name}.{factor}.{short}", model, num_experts)
                if split_dim is None:
                    offsets = ()
                    replica_id = (0, module.tp_rank, dp_rank)
                else:
                    offsets = ((split_dim, module.tp_rank, module.tp_size),)
                    replica_id = (0, 0, dp_rank)
                out[key] = ShardedTensor.from_rank_offsets(
                    key, param, *offsets, replica_id=replica_id
                )
    return out
