"""Core attention of the local (non-TransformerEngine) layer spec through torch's SDPA.

megatron-core's ``DotProductAttention`` materialises the attention scores: ``[b * heads, T, T]``
per layer, kept for the backward in the softmax's dtype, and a masked softmax over them. For a
THD-packed row of ``T`` tokens that is ``heads * T^2`` values per layer (a 1.7B Qwen3 at
``T = 4096``: 16 heads, 0.5 GiB per layer in bf16, 14 GiB over 28 layers), and it is what made
the megatron backend slower and twice as hungry as the FSDP one on the device.

:class:`SDPAttention` computes the same function with ``torch.nn.functional.
scaled_dot_product_attention`` and the same boolean block-causal mask (inverted: megatron masks
where the mask is True, SDPA attends where it is True): on a GPU that is the memory-efficient
kernel, which never stores the scores (the backward recomputes them), with grouped-query heads
shared without copies (``enable_gqa``). What SDPA cannot express falls back to megatron's own
forward: a softmax offset (``--softmax-type off-by-one|learnable``), sliding-window layers, an
attention bias, and packed-sequence params (the THD format of TransformerEngine).

With ``--attn-implementation varlen`` the ``attention_mask`` argument carries the packed row's
sample boundaries instead of a mask (:func:`miles_megatron.packed_attention.varlen_mask`) and
the forward is :func:`miles_core.varlen_attention.varlen_causal_attention` (torch's varlen
flash kernel on a GPU): the same function without the ``T x T`` mask or the masked-out blocks'
work. Where varlen cannot serve a call (the fallback cases above, attention dropout in training,
a batch of more than one row) the boundaries become the block mask and the call takes the
masked path.

At ``--context-parallel-size > 1`` the queries are this CP rank's shard of the row and the keys
and values are all-gathered over the CP group first (:mod:`miles_megatron.context_parallel`:
the mask's key columns follow the gathered order); megatron's own forward has no CP, so there
the fallback cases raise.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from miles_core.varlen_attention import varlen_causal_attention

from miles_megatron.context_parallel import gather_sequence
from miles_megatron.packed_attention import block_mask, read_varlen_mask


def sdpa_attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    dropout: float = 0.0,
    causal: bool = False,
    cp_group=None,
) -> torch.Tensor:
    """``softmax(scale * q k^T, mask) v`` per head through SDPA: ``[s, b, heads, d]`` in (keys and
    values may have fewer, grouped heads), ``[s, b, heads, d]`` out. ``mask``: boolean, True
    where a query attends. With ``cp_group`` the keys and values are this CP rank's and are
    all-gathered over the group first; ``mask``'s columns follow the gathered order."""
    if cp_group is not None:
        if mask is None:
            raise ValueError("context parallelism needs the packed row's attention mask")
        key, value = gather_sequence(key, cp_group), gather_sequence(value, cp_group)
    # [s, b, h, d] -> [b, h, s, d]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    context = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=dropout,
        is_causal=causal,
        scale=scale,
        enable_gqa=q.size(1) != k.size(1),
    )
    # [b, h, s, d] -> [s, b, h, d]
    return context.permute(2, 0, 1, 3).contiguous()


class SDPAttention(DotProductAttention):
    """``DotProductAttention`` (same constructor, parameters and checkpoint) whose forward is
    one SDPA call: ``softmax(scale * q k^T, masked) v`` per head, inputs ``[s, b, heads, d]``,
    output ``[s, b, heads * d]``."""

    def __init__(self, config, *args, **kwargs) -> None:
        # megatron's DotProductAttention refuses CP > 1 (only TE's attends across CP ranks);
        # this forward does, so the parent is built from a CP = 1 view of the same config
        cp_size = config.context_parallel_size
        if cp_size > 1:
            view = copy.copy(config)
            view.context_parallel_size = 1
            super().__init__(view, *args, **kwargs)
            self.config = config
        else:
            super().__init__(config, *args, **kwargs)
        self.cp_size = cp_size

    def _sdpa_supported(self, attention_bias, packed_seq_params) -> bool:
        return (
            attention_bias is None
            and packed_seq_params is None
            and self.softmax_offset is None
            and self.scale_mask_softmax.window_size is None
        )

    def _scale(self) -> float:
        # megatron folds query-key layer scaling into the softmax (scale / coeff, then * coeff)
        scale = self.softmax_scale
        if self.config.apply_query_key_layer_scaling:
            scale *= self.layer_number
        return scale

    def _varlen_forward(self, query, key, value, cu_seqlens, max_seqlen) -> torch.Tensor:
        """One packed row ``[T, 1, heads, d]`` through the varlen kernel -> ``[T, 1, h * d]``."""
        q, k, v = query[:, 0], key[:, 0], value[:, 0]  # [T, heads, d]
        context = varlen_causal_attention(q, k, v, cu_seqlens, max_seqlen, self._scale())
        return context.reshape(context.size(0), 1, self.hidden_size_per_partition)

    @torch.compiler.disable  # --compile-decoder-layers: attention stays eager, outside the graph
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        dropout = self.attention_dropout.p if self.training else 0.0
        varlen = read_varlen_mask(attention_mask)
        if varlen is not None:
            cu_seqlens, max_seqlen = varlen
            if (
                self._sdpa_supported(attention_bias, packed_seq_params)
                and self.cp_size == 1
                and not dropout
                and query.size(1) == 1
            ):
                return self._varlen_forward(query, key, value, cu_seqlens, max_seqlen)
            if self.cp_size > 1:
                raise RuntimeError("--context-parallel-size > 1 attends through the masked path")
            attention_mask = block_mask(cu_seqlens, query.size(0))
        if not self._sdpa_supported(attention_bias, packed_seq_params):
            if self.cp_size > 1:
                raise RuntimeError(
                    "--context-parallel-size > 1 attends through SDPA only: no softmax offset, "
                    "sliding window, attention bias or packed-sequence params"
                )
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
            )
        scale = self._scale()
        mask = None if attention_mask is None else ~attention_mask.to(torch.bool)
        causal = mask is None and (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        cp_group = None
        if self.cp_size > 1:
            cp_group = ps.get_context_parallel_group()

        def attend() -> torch.Tensor:
            return sdpa_attend(query, key, value, mask, scale, dropout, causal, cp_group)

        if dropout and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = attend()
        else:
            context = attend()
        return context.view(*context.shape[:2], self.hidden_size_per_partition)
