"""The rollout's log-prob pass on THD-packed rows (miles-core packing), at any pipeline size.

megatron-core's local spec attends with an explicit mask, so a packed row ``[1, T]`` gets the
block-diagonal causal mask of miles-core's ``block_causal_mask`` (inverted: megatron masks
where the mask is True) and positions that restart at 0 in every sample. The last stage scores
the tokens with the fused vocabulary-parallel head (:mod:`miles_megatron.output_head`); with
``--no-fused-log-probs`` the output layer gathers the vocabulary over TP
(``parallel_output=False``) into ``[1, T, V]`` logits. Either way every TP rank holds the same
log-probs and the same loss. ``T`` is a multiple of
:func:`~miles_megatron.context_parallel.row_pad_multiple` (128, and ``2 x CP x TP``).

At CP > 1 each CP rank scores its shard of the row, and
:meth:`~miles_megatron.context_parallel.PackedShard.gather_row` brings the whole row back on
every CP rank before it is cut into samples.

The micro-batches go through megatron's schedule (:mod:`miles_megatron.schedule`); with PP > 1
the last stage computes the log-probs and broadcasts them to the other stages.

The critic's values (:func:`rollout_values`) take the same path with the value head's scores
(:class:`~miles_megatron.value_head.ValueScores`).
"""

from __future__ import annotations

import torch
from miles_core.batch import RolloutBatch
from miles_core.packing import pack_thd, unpack_response

from miles_megatron.context_parallel import PackedShard, row_pad_multiple
from miles_megatron.output_head import ScoreHead
from miles_megatron.schedule import broadcast_from_last_stage, run_schedule
from miles_megatron.value_head import ValueScores


@torch.no_grad()
def _per_sample(
    model: torch.nn.Module,
    micro_batches: list[RolloutBatch],
    num_samples: int,
    source_index: dict[int, int],
    head,
    device: torch.device,
) -> list[torch.Tensor]:
    """Per-sample response-aligned first score of ``head`` (CPU float32), on every stage."""
    out: list[torch.Tensor | None] = [None] * num_samples

    def on_scores(index: int, shard: PackedShard, scores: torch.Tensor, *_: torch.Tensor) -> None:
        full = shard.full
        rows = unpack_response(full, shard.gather_row(scores))
        for src, values in zip(full.source_indices, rows):
            out[source_index[src]] = values.float().cpu()

    multiple = row_pad_multiple()
    packed = [pack_thd(mb, pad_multiple=multiple).to(device) for mb in micro_batches]
    run_schedule(model, packed, head, on_scores, forward_only=True)
    return broadcast_from_last_stage(out)  # type: ignore[return-value]


def rollout_log_probs(
    model: torch.nn.Module,
    micro_batches: list[RolloutBatch],
    num_samples: int,
    source_index: dict[int, int],
    vocab_size: int,
    temperature: float,
    device: torch.device,
    fused: bool = True,
) -> list[torch.Tensor]:
    """Per-sample response log-probs (CPU float32) at ``temperature`` over ``micro_batches``,
    on every pipeline stage (``fused``: ``--fused-log-probs``)."""
    head = ScoreHead(vocab_size, temperature, fused, entropy_grad=False)
    return _per_sample(model, micro_batches, num_samples, source_index, head, device)


def rollout_values(
    model: torch.nn.Module,
    micro_batches: list[RolloutBatch],
    num_samples: int,
    source_index: dict[int, int],
    device: torch.device,
) -> list[torch.Tensor]:
    """Per-sample values ``V_t`` (CPU float32) of every response token's state: the critic
    ``model``'s value head (:mod:`miles_megatron.value_head`)."""
    return _per_sample(model, micro_batches, num_samples, source_index, ValueScores(), device)
