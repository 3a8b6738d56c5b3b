"""A GPTModel forward on a THD-packed row (miles-core packing), and the rollout's log-prob pass.

megatron-core's local spec attends with an explicit mask, so a packed row ``[1, T]`` gets the
block-diagonal causal mask of miles-core's ``block_causal_mask`` (inverted: megatron masks
where the mask is True) and positions that restart at 0 in every sample. The output layer
gathers the vocabulary over TP (``parallel_output=False``), so every TP rank holds the same
``[1, T, V]`` logits and the same loss. ``T`` is a multiple of ``pack_thd``'s pad multiple
(128), which sequence parallelism needs to be divisible by TP.
"""

from __future__ import annotations

import torch
from miles_core.batch import RolloutBatch
from miles_core.log_probs import token_log_probs
from miles_core.packing import PackedBatch, block_causal_mask, pack_thd, unpack_response


def packed_logits(model: torch.nn.Module, packed: PackedBatch, vocab_size: int) -> torch.Tensor:
    """Logits ``[1, T, vocab_size]`` (padded vocabulary entries dropped), float32."""
    mask = ~block_causal_mask(packed)
    logits = model(packed.input_ids, packed.position_ids, attention_mask=mask)
    return logits[..., :vocab_size].float()


@torch.no_grad()
def rollout_log_probs(
    model: torch.nn.Module,
    micro_batches: list[RolloutBatch],
    num_samples: int,
    source_index: dict[int, int],
    vocab_size: int,
    temperature: float,
    device: torch.device,
) -> list[torch.Tensor]:
    """Per-sample response log-probs (CPU float32) at ``temperature`` over ``micro_batches``."""
    out: list[torch.Tensor | None] = [None] * num_samples
    for mb in micro_batches:
        packed = pack_thd(mb).to(device)
        logits = packed_logits(model, packed, vocab_size)
        lp = token_log_probs(logits, packed.targets, temperature)
        for src, values in zip(mb.source_indices, unpack_response(packed, lp)):
            out[source_index[src]] = values.float().cpu()
    return out  # type: ignore[return-value]
