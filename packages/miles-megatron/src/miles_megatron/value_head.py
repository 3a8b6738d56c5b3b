"""The critic's value head on the megatron GPTModel: ``Linear(hidden_size, 1)`` in place of the
last stage's ``output_layer``, replicated on every TP rank.

:func:`install_value_head` replaces the output layer of the bare GPTModel (after the HF weights
are loaded, before DDP) by :class:`ValueHeadLinear`, initialised by miles-core's
:func:`~miles_core.value_head.initial_value_head_weight` (``--seed``), and unties the embeddings
(the head is its own 1-output layer). The model's forward is otherwise untouched: it hands the
final hidden states ``[s, b, h]`` to the head and returns ``[b, s, 1]``.

Tensor parallelism: the head is replicated, not row-parallel. Without sequence parallelism its
input is replicated on the TP ranks, so every rank computes the same values, the same loss and
the same (full) gradient of the head and of the hidden states, which is what a replicated
activation's gradient is (the layers below all-reduce their input gradients themselves). With
``--sequence-parallel`` the hidden states arrive split along the sequence: the head all-gathers
them first with ``tensor_parallel_output_grad=False`` (backward keeps this rank's slice of the
identical full gradient), as :mod:`miles_megatron.output_head` does. The head's parameters carry
no ``tensor_model_parallel`` attribute: megatron's grad-norm counts them once, and its
checkpoint treats them as replicated over TP.

:class:`ValueScores` is the schedule's head for the critic (:func:`~miles_megatron.schedule.
run_schedule`): the last stage's output ``[1, T, 1]`` as float32 values ``[1, T]``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from miles_core.packing import PackedBatch
from miles_core.value_head import initial_value_head_weight
from torch import nn


class ValueHeadLinear(nn.Linear):
    """``Linear(hidden_size, 1)`` with megatron's output-layer call signature."""

    def __init__(self, hidden_size: int, sequence_parallel: bool) -> None:
        super().__init__(hidden_size, 1, bias=True)
        self.sequence_parallel = sequence_parallel

    def forward(  # type: ignore[override]
        self, input_: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        hidden = input_
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(
                hidden,
                tensor_parallel_output_grad=False,
                group=ps.get_tensor_model_parallel_group(),
            )
        return super().forward(hidden), None


def install_value_head(model: nn.Module, seed: int) -> None:
    """Replace the (last stage's) output layer of the bare GPTModel ``model`` by the value head
    with its seeded initial weights, in the dtype and on the device of the model's parameters."""
    # every stage: the head is not the embedding, so no stage joins megatron's all-reduce of
    # tied embedding gradients between the first and the last stage
    model.share_embeddings_and_output_weights = False
    if not getattr(model, "post_process", False):
        return  # an earlier pipeline stage: no output layer
    config = model.config
    ref = next(model.parameters())
    head = ValueHeadLinear(config.hidden_size, bool(config.sequence_parallel))
    with torch.no_grad():
        head.weight.copy_(initial_value_head_weight(config.hidden_size, seed))
        head.bias.zero_()
    model.output_layer = head.to(device=ref.device, dtype=ref.dtype)


class ValueScores:
    """The schedule's head for the critic: ``(values,)`` ``[1, T]`` float32 of the last stage's
    ``[1, T, 1]`` output."""

    def context(self, model: nn.Module, packed: PackedBatch, last_stage: bool):
        return contextlib.nullcontext()

    def scores(self, output: torch.Tensor, packed: PackedBatch) -> tuple[torch.Tensor]:
        return (output[..., 0].float(),)
