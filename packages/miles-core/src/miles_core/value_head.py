"""The critic's value head, as every backend initialises it: ``Linear(hidden_size, 1)`` on the
final hidden states in place of the LM head, weights ``VALUE_HEAD_INIT_STD * randn`` from a
generator seeded with ``--seed`` (float64 draws), bias 0, so every run and every backend starts
from the same critic. Position ``t`` of its output is the value of the state that predicts the
token at ``t``, aligned as log-probs are (:mod:`miles_core.packing`)."""

from __future__ import annotations

import torch

#: Standard deviation of the value head's initial weights (its bias starts at 0).
VALUE_HEAD_INIT_STD = 0.02


def initial_value_head_weight(hidden_size: int, seed: int) -> torch.Tensor:
    """The head's initial weight ``[1, hidden_size]`` (float64; the bias starts at 0)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn((1, hidden_size), generator=g, dtype=torch.float64)
    return weight * VALUE_HEAD_INIT_STD
