"""One optimizer step over a list of micro-batches, FSDP2-aware.

Loss scaling (why the update does not depend on the DP size or the micro-batch split): the
caller's ``loss_of(model, mb)`` returns the micro-batch's *contribution* to the step loss, i.e.
``sum(token_losses in mb) / D`` where ``D`` is the step's global denominator (summed over all
data-parallel ranks and micro-batches). The step loss ``L = sum over ranks, micro-batches`` of
those contributions. Each rank back-propagates ``dp_size * contribution`` because FSDP2 averages
gradients over the data-parallel ranks (reduce-scatter then divide by ``dp_size``), so the
reduced gradient is exactly ``dL/dw`` whatever the split.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from miles_core.metric_reduction import StepMetrics
from torch import nn

from miles_fsdp.loss_scale import LossScaler
from miles_fsdp.optimizer import clip_grad_norm

LossFn = Callable[[nn.Module, Any], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class StepResult:
    """Metrics of one optimizer step; ``parts`` hold the loss's metrics combined over the
    micro-batches and DP ranks (:mod:`miles_core.metric_reduction`)."""

    loss: float
    parts: dict[str, float]
    grad_norm: float
    lr: float


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    micro_batches: Sequence[Any],
    loss_of: LossFn,
    dp_size: int,
    clip_grad: float,
    loss_scaler: LossScaler | None = None,
) -> StepResult:
    """Accumulate the gradients of ``micro_batches``, clip, step AdamW and the LR schedule.

    ``loss_of`` returns ``(contribution, parts)``: the scalar to back-propagate (see the module
    docstring) and named scalar parts (already global-denominator scaled) for the metrics.
    With ``loss_scaler`` (fp16) the backward pass runs on the scaled loss and the gradients are
    unscaled before clipping; a step with a non-finite gradient norm is skipped either way, and
    then the LR schedule does not advance.
    """
    optimizer.zero_grad(set_to_none=True)
    total: torch.Tensor | float = 0.0
    parts = StepMetrics()
    scale = loss_scaler.scale if loss_scaler is not None else 1.0
    for mb in micro_batches:
        contribution, mb_parts = loss_of(model, mb)
        (contribution * (dp_size * scale)).backward()
        # accumulated where they live: no host synchronisation per micro-batch
        total = total + contribution.detach().float()
        parts.add(mb_parts)
    if loss_scaler is not None:
        loss_scaler.unscale_(model)
    norm = clip_grad_norm(model, clip_grad)
    # the metrics' all-reduce and the norm come to the host in one wait, before the step
    parts.add({"step_loss": torch.as_tensor(total)})
    reduced, grad_norm = parts.reduce(also=norm)
    lr = optimizer.param_groups[0]["lr"]
    finite = math.isfinite(grad_norm)
    if finite:  # a skipped step does not advance the LR schedule (as under Megatron)
        optimizer.step()
        scheduler.step()
    if loss_scaler is not None:
        loss_scaler.update(found_inf=not finite)
    loss = reduced.pop("step_loss")
    return StepResult(loss=loss, parts=reduced, grad_norm=grad_norm, lr=lr)
