"""LR schedule against the formulas, computed independently in float64."""

from __future__ import annotations

import math

import pytest
import torch
from miles_core.args.groups import OffloadArgs, OptimizerArgs
from miles_core.optimizer import optimizer_config
from miles_fsdp.optimizer import build_optimizer, lr_at


def reference(step, lr, min_lr, warmup, decay_iters, style):
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / (decay_iters - warmup))
    if style == "constant":
        return lr
    if style == "linear":
        return lr - (lr - min_lr) * progress
    return min_lr + (lr - min_lr) * (math.cos(math.pi * progress) + 1) / 2


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_schedule_matches_formula(style):
    group = OptimizerArgs(
        lr=3e-4, min_lr=1e-5, lr_warmup_iters=5, lr_decay_style=style, lr_decay_iters=25
    )
    cfg = optimizer_config(group, OffloadArgs())
    model = torch.nn.Linear(2, 2)
    optimizer, scheduler = build_optimizer(model, cfg)
    for step in range(40):
        expected = reference(step, 3e-4, 1e-5, 5, 25, style)
        assert lr_at(step, cfg) == pytest.approx(expected, rel=1e-12)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12)
        optimizer.step()
        scheduler.step()


def test_no_warmup_starts_at_peak():
    assert lr_at(0, optimizer_config(OptimizerArgs(lr=1e-3), OffloadArgs())) == 1e-3
