"""The critic role's model: the actor's HF architecture with a value head as its output layer.

The critic is built by the one build path (:func:`miles_fsdp.build.build_model`) from
``--hf-checkpoint`` with ``tie_word_embeddings`` off and its LM head replaced by
``nn.Linear(hidden_size, 1)`` (the value head): on the meta skeleton before sharding
(:func:`install_value_head`) and on rank 0's loaded model before its state is broadcast
(:func:`value_head_fixup`, miles-core's seeded initialisation,
:func:`miles_core.value_head.initial_value_head_weight`, so every run starts from the same critic).
The model's forward then returns ``logits`` of shape ``[1, T, 1]``: position ``t`` holds the
value of the state that predicts the token at ``t``, aligned as log-probs are
(:mod:`miles_core.packing`), so :func:`~miles_core.packing.unpack_response` gives the value
``V_t`` of each response token's state.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from miles_core.value_head import initial_value_head_weight
from torch import nn


def critic_config(config: Any) -> Any:
    """The actor's HF config with untied embeddings (the head is a separate 1-output layer)."""
    out = copy.deepcopy(config)
    out.tie_word_embeddings = False
    text = getattr(out, "text_config", None)
    if text is not None and text is not out:
        text.tie_word_embeddings = False
    return out


def _hidden_size(config: Any) -> int:
    text = getattr(config, "text_config", None)
    return int((text if text is not None else config).hidden_size)


def install_value_head(model: nn.Module, config: Any) -> None:
    """Replace the output layer by an (uninitialised) ``Linear(hidden_size, 1)`` in place."""
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output layer to replace by a value head")
    device, dtype = head.weight.device, head.weight.dtype
    model.set_output_embeddings(
        nn.Linear(_hidden_size(config), 1, bias=True, device=device, dtype=dtype)
    )


def value_head_fixup(seed: int):
    """A post-load fixup installing a value head with seeded initial weights."""

    def fixup(model: nn.Module, config: Any) -> None:
        install_value_head(model, config)
        head = model.get_output_embeddings()
        with torch.no_grad():
            head.weight.copy_(initial_value_head_weight(head.weight.shape[1], seed))
            head.bias.zero_()

    return fixup


def values_of(logits: torch.Tensor) -> torch.Tensor:
    """Per-position values ``[1, T]`` (float32) of the critic's ``[1, T, 1]`` output."""
    return logits[..., 0].float()
