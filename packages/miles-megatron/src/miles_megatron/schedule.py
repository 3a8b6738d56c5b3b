"""Micro-batches through megatron-core's forward/backward schedule, at any pipeline and CP size.

:func:`run_schedule` hands this CP rank's shard of each THD-packed micro-batch
(:mod:`miles_megatron.context_parallel`; the whole row at CP = 1) to
``megatron.core.pipeline_parallel.get_forward_backward_func()``: at PP = 1 that is
``forward_backward_no_pipelining``, at PP > 1 the non-interleaved 1F1B schedule (warm-up
forwards, one-forward-one-backward, cool-down backwards), with hidden states sent between stages
by megatron's P2P communicator (``variable_seq_lengths``: every micro-batch's padded length is
exchanged first). Every stage runs the model on the same shard (the first stage embeds
``input_ids``; all stages need the block-causal mask, or the row's boundaries under
``--attn-implementation varlen``); only the last stage scores the shard's
tokens (:class:`~miles_megatron.output_head.ScoreHead`: the fused head, or the logits on the
dense path) and calls ``on_scores``.

Loss scaling: ``on_scores`` returns this rank's share of the step loss as miles-core defines it
(its tokens' terms, already divided by the step's global denominator, see
:mod:`miles_megatron.train_step`). megatron's schedule multiplies a returned loss by the CP size
and divides it by the number of micro-batches before back-propagating; :func:`run_schedule`
returns ``loss * num_microbatches`` to it, so ``cp * loss`` is back-propagated, and megatron's
DDP divides the gradients it sums over DP x CP by ``dp * cp``: the CP ranks' shares add up.

:func:`broadcast_from_last_stage` sends a picklable value (log-probs, metrics) from the last
stage to every stage of the pipeline group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from miles_core.packing import PackedBatch

from miles_megatron.context_parallel import PackedShard, shard_micro_batches
from miles_megatron.output_head import LogitsHead, ScoreHead
from miles_megatron.packed_attention import attn_implementation_of, varlen_mask
from miles_megatron.routing_replay import clear_routed_experts, set_routed_experts
from miles_megatron.value_head import ValueScores

#: ``on_scores(index, shard, *head.scores(...))`` -> this rank's share of the loss (training)
#: or None: ``(log_probs, entropy)`` of :class:`ScoreHead`, ``(logits,)`` of :class:`LogitsHead`,
#: ``(values,)`` of the critic's :class:`ValueScores`.
ScoresCallback = Callable[..., torch.Tensor | None]


def stage_forward(model: torch.nn.Module, shard: PackedShard) -> torch.Tensor:
    """This stage's output on a CP rank's shard of a packed row: hidden states, or on the last
    stage ``[1, T / cp, 2]`` scores inside :func:`~miles_megatron.output_head.scoring`, else
    ``[1, T / cp, V_padded]`` logits (the vocabulary gathered over TP). The layers get the row's
    block-causal mask, or under ``--attn-implementation varlen`` its sample boundaries
    (:mod:`miles_megatron.packed_attention`)."""
    if shard.cp_size == 1 and attn_implementation_of(model) == "varlen":
        mask = varlen_mask(shard.full.cu_seqlens, shard.full.max_seqlen)  # boundaries, no mask
    else:
        mask = ~shard.attention_mask()  # megatron masks where True
    return model(shard.input_ids, shard.position_ids, attention_mask=mask)


def run_schedule(
    model: torch.nn.Module,
    micro_batches: Sequence[PackedBatch],
    head: ScoreHead | LogitsHead | ValueScores,
    on_scores: ScoresCallback,
    forward_only: bool,
) -> None:
    """Forward (and, unless ``forward_only``, backward) every micro-batch through the schedule.

    ``on_scores`` sees this CP rank's shard and its float32 log-probs and entropies
    ``[1, T / cp]`` at ``head.temperature`` on the last pipeline stage only. Gradients accumulate
    in the DDP buffers; the caller finalises them (``finalize_model_grads``) and steps the
    optimizer.
    """
    count = len(micro_batches)
    last_stage = ps.is_pipeline_last_stage()
    shards = shard_micro_batches(list(micro_batches))
    items = iter(enumerate(shards))

    def forward_step(data_iterator, module):
        index, shard = next(data_iterator)
        set_routed_experts(module, shard.full.routed_experts)  # R3; held through the backward
        with head.context(module, shard, last_stage):
            output = stage_forward(module, shard)

        def loss_func(output_tensor: torch.Tensor):
            loss = on_scores(index, shard, *head.scores(output_tensor, shard))
            if loss is None:
                loss = output_tensor.new_zeros((), dtype=torch.float32)
            return loss * count, {}

        return output, loss_func

    try:
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=items,
            model=[model],
            num_microbatches=count,
            seq_length=max(p.num_tokens for p in micro_batches),  # megatron divides by CP, TP
            micro_batch_size=1,
            forward_only=forward_only,
        )
    finally:
        clear_routed_experts(model)


def broadcast_from_last_stage(value: Any) -> Any:
    """``value`` of the last pipeline stage, on every stage of this rank's pipeline group."""
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return value
    group = ps.get_pipeline_model_parallel_group()
    box = [value if ps.is_pipeline_last_stage() else None]
    dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(), group=group)
    return box[0]
