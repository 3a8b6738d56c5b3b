"""Test support shared by both backends' critic tests: the float64 reference critic's head."""

from __future__ import annotations

import torch


def attach_value_head(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Replace ``model.lm_head`` (a float64 HF causal LM) by ``Linear(hidden, 1)`` with weights
    ``0.02 * randn`` of a generator seeded with ``seed`` and bias 0: the documented
    initialisation of the critic's value head (``--seed``). Returns ``model``."""
    hidden = model.config.hidden_size
    head = torch.nn.Linear(hidden, 1, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(0.02 * torch.randn((1, hidden), generator=g, dtype=torch.float64))
        head.bias.zero_()
    model.lm_head = head
    return model
