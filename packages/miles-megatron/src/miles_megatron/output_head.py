"""megatron-core's output layer as miles-core's fused, vocabulary-parallel log-prob head.

While :func:`scoring` is active on the last pipeline stage, the GPTModel's ``output_layer`` (a
``ColumnParallelLinear`` holding this TP rank's rows of the padded vocabulary, or handed the
shared embedding's weight when the embeddings are tied) returns ``[s, b, 2]`` = (log-prob of the
target, entropy) from :func:`miles_core.log_prob_head.fused_log_probs` over the TP group
instead of logits: the row maximum and the sums are all-reduced per chunk of tokens, the logits
are never gathered across TP and never exist for all tokens at once. The model's forward is
otherwise untouched (it transposes the output to ``[b, s, 2]``).

The head's backward all-reduces the hidden states' gradient over the TP group, which is what the
layer's own input mapping does: without sequence parallelism the hidden states enter as they
are (replicated on the TP ranks); with it they are all-gathered along the sequence first with
``tensor_parallel_output_grad=False`` (backward keeps this rank's slice of the already reduced
gradient). Context parallelism only changes which tokens a rank holds; the head is per token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from miles_core.log_prob_head import dense_log_probs, fused_log_probs
from miles_core.packing import PackedBatch

from miles_megatron.sharding import unwrap


@contextlib.contextmanager
def scoring(
    model: torch.nn.Module,
    targets: torch.Tensor,
    temperature: float,
    vocab_size: int,
    entropy_grad: bool = True,
) -> Iterator[None]:
    """Within: the last stage's output layer returns ``[s, b, 2]`` (log-prob of ``targets``
    ``[b, s]``, entropy) at ``temperature``, float32, over the real ``vocab_size``; the entropy
    carries a gradient only with ``entropy_grad``."""
    head = unwrap(model).output_layer
    group = ps.get_tensor_model_parallel_group()

    def forward(input_: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None):
        weight = head.weight if weight is None else weight
        hidden = input_
        if head.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False, group=group
            )
        lp, ent = fused_log_probs(
            hidden,
            weight,
            targets.transpose(0, 1),
            temperature,
            vocab_size=vocab_size,
            group=group,
            entropy_grad=entropy_grad,
        )
        return torch.stack([lp, ent], dim=-1), None

    head.forward = forward
    try:
        yield
    finally:
        del head.forward


@dataclass
class ScoreHead:
    """How the last stage turns a micro-batch's output into ``(log_probs, entropy)`` ``[1, T]``:
    the fused head (``--fused-log-probs``) or the materialised logits (the dense path, where the
    entropy keeps a graph only with ``entropy_grad``)."""

    vocab_size: int
    temperature: float
    fused: bool = True
    entropy_grad: bool = True

    def context(self, model: torch.nn.Module, packed: PackedBatch, last_stage: bool):
        if self.fused and last_stage:
            return scoring(
                model, packed.targets, self.temperature, self.vocab_size, self.entropy_grad
            )
        return contextlib.nullcontext()

    def scores(
        self, output: torch.Tensor, packed: PackedBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            return output[..., 0], output[..., 1]
        logits = output[..., : self.vocab_size].float()
        return dense_log_probs(logits, packed.targets, self.temperature, self.entropy_grad)


@dataclass
class LogitsHead:
    """The last stage's output as the ``[1, T, V]`` logits of the real vocabulary (gathered over
    TP: ``parallel_output=False``), for a ``--custom-loss-function-path`` hook taking
    ``logits`` (:mod:`miles_core.custom_loss`)."""

    vocab_size: int

    def context(self, model: torch.nn.Module, packed: PackedBatch, last_stage: bool):
        return contextlib.nullcontext()

    def scores(self, output: torch.Tensor, packed: PackedBatch) -> tuple[torch.Tensor]:
        return (output[..., : self.vocab_size],)
