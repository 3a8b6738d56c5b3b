"""One AdamW update through torch's own functional kernel, as ``torch.optim.AdamW`` runs it.

``adamw_update`` calls ``torch.optim.adam.adam(..., decoupled_weight_decay=True)`` with the
group's ``lr``, ``betas``, ``eps`` and ``weight_decay`` and the ``foreach`` / ``fused``
choice of ``config`` (None lets torch choose from the tensors, as AdamW's defaults do). Per
element::

    p <- p * (1 - lr * wd)
    m <- lerp(m, g, 1 - b1);  v <- b2 * v + (1 - b2) * g * g
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

so calling it on any partition of a parameter's elements gives the bits AdamW gives on the
whole parameter (with the same kernel choice).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.adam import adam
from torch.optim.optimizer import _get_scalar_dtype


def adamw_update(group: dict, params, grads, exp_avgs, exp_avg_sqs, steps, config: Any) -> None:
    """One decoupled-weight-decay Adam step of ``params`` in place (``steps`` incremented)."""
    beta1, beta2 = group["betas"]
    adam(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        foreach=config.foreach,
        capturable=False,
        differentiable=False,
        fused=config.fused,
        grad_scale=None,
        found_inf=None,
        has_complex=False,
        decoupled_weight_decay=True,
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=False,
    )


def step_tensors(counts: list[int], device: torch.device, fused: bool) -> list[torch.Tensor]:
    """One step counter per tensor, as AdamW keeps them (device float32 when fused)."""
    if fused:
        return list(torch.tensor(counts, dtype=torch.float32, device=device).unbind(0))
    return list(torch.tensor(counts, dtype=_get_scalar_dtype()).unbind(0))


def new_adamw_state(p: torch.Tensor, step: int, fused: bool) -> dict[str, torch.Tensor]:
    """Zero moments and a step counter, as ``torch.optim.AdamW`` creates them."""
    return {
        "step": torch.tensor(float(step), dtype=torch.float32, device=p.device)
        if fused
        else torch.tensor(float(step), dtype=_get_scalar_dtype()),
        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }
