"""megatron-core's local (non-TransformerEngine) GPT layer spec, usable with sequence parallelism,
attending through torch's SDPA.

``get_gpt_layer_local_spec`` builds its norms with ``WrappedTorchNorm``, which refuses
``sequence_parallel`` (and megatron-core requires sequence parallelism for MoE with TP > 1).
Sequence parallelism needs nothing from the norm itself: each rank normalises its own tokens,
and the norm weights' gradients are summed over the TP group by ``finalize_model_grads`` for
every parameter marked ``sequence_parallel``. :class:`SequenceParallelTorchNorm` is the torch
norm with that mark; :func:`local_block_spec` swaps it in everywhere (layers and final norm),
and swaps megatron's ``DotProductAttention`` for :class:`~miles_megatron.sdpa_attention.
SDPAttention` (the same function without materialising the attention scores).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from miles_megatron.sdpa_attention import SDPAttention


class SequenceParallelTorchNorm:
    """``torch.nn.RMSNorm`` / ``LayerNorm`` whose weights carry the ``sequence_parallel`` mark."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:
        if config.normalization == "RMSNorm":
            norm: torch.nn.Module = torch.nn.RMSNorm(hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"--normalization {config.normalization!r} is not supported")
        if config.sequence_parallel:
            for param in norm.parameters():
                param.sequence_parallel = True
        return norm


def _swap(spec: Any, old: type, new: type) -> Any:
    """Replace ``old`` by ``new`` everywhere in a ModuleSpec tree (returns a new tree)."""
    if spec is old:
        return new
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(
            spec,
            module=new if spec.module is old else spec.module,
            submodules=_swap(spec.submodules, old, new),
        )
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: _swap(getattr(spec, f.name), old, new) for f in dataclasses.fields(spec)}
        return dataclasses.replace(spec, **changes)
    return spec


def local_block_spec(margs: dict, config: Any, vp_stage: int | None = None) -> Any:
    """This stage's ``TransformerBlockSubmodules`` from the local spec, SP-capable norms."""
    layer = get_gpt_layer_local_spec(
        num_experts=margs.get("num_experts"),
        moe_grouped_gemm=False,  # local_experts.<e>: the bridge's names (--moe-grouped-gemm refused)
        qk_layernorm=bool(margs.get("qk_layernorm")),
        normalization=margs.get("normalization"),
    )

    layer = _swap(layer, WrappedTorchNorm, SequenceParallelTorchNorm)
    layer = _swap(layer, DotProductAttention, SDPAttention)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(
        layer_specs=[layer] * count, layer_norm=SequenceParallelTorchNorm
    )
