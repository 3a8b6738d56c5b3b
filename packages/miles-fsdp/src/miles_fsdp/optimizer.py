"""AdamW, the learning-rate schedule and gradient clipping over FSDP2 (DTensor) parameters.

The configuration and the schedule are miles-core's (:mod:`miles_core.optimizer`, shared with
the Megatron backend): :func:`build_scheduler` is a ``LambdaLR`` of ``cfg.lr_at(step)``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
from miles_core.optimizer import OptimizerConfig, lr_at
from miles_offload.streamed_adam import StreamedAdamConfig, StreamedAdamW
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = [
    "OptimizerConfig",
    "build_optimizer",
    "build_scheduler",
    "build_streamed_optimizer",
    "clip_grad_norm",
    "is_streamed",
    "lr_at",
]


def build_optimizer(
    model: nn.Module, cfg: OptimizerConfig
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable parameters plus its ``LambdaLR`` schedule.

    The fused kernel is used when every parameter lives on a CUDA device, else ``foreach``.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    on_cuda = bool(params) and all(p.device.type == "cuda" for p in params)
    optimizer = torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        fused=True if on_cuda else None,
        foreach=None if on_cuda else True,
    )
    return optimizer, build_scheduler(optimizer, cfg)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimizerConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """The ``LambdaLR`` that sets every param group's LR to :func:`lr_at` of the step."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: cfg.lr_at(step) / cfg.lr if cfg.lr else 0.0
    )


def build_streamed_optimizer(
    model: nn.Module, cfg: OptimizerConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """``--stream-optimizer-state-to-disk``: miles-offload's streamed AdamW plus the same schedule.

    Masters and moments of the parameters with at least ``--stream-optimizer-min-numel``
    elements live in bucket files under ``--offload-train-disk-dir``; the arithmetic (and the
    fused / foreach choice) is that of :func:`build_optimizer`, so with fp32 moments the
    weights are bit-identical. Hyperparameters come from ``cfg`` like the in-memory AdamW's,
    the file settings from ``cfg.streamed``.
    """
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    on_cuda = bool(params) and all(p.device.type == "cuda" for _, p in params)
    config = StreamedAdamConfig(
        **asdict(cfg.streamed),
        foreach=None if on_cuda else True,
        fused=True if on_cuda else None,
    )
    optimizer = StreamedAdamW(
        params,
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        config=config,
    )
    return optimizer, build_scheduler(optimizer, cfg)


def is_streamed(optimizer: Any) -> bool:
    """Whether ``optimizer`` keeps its state in files (checkpointed with ``save``/``load``)."""
    return isinstance(optimizer, StreamedAdamW)


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm (over all shards) to ``max_norm``; return the pre-clip norm
    as a 0-d tensor where the gradients are (no host wait: the caller reads it with the step's
    metrics).

    ``max_norm <= 0`` disables clipping; the norm is still computed and returned.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(
        params, max_norm if max_norm > 0 else float("inf"), foreach=True
    )
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return torch.as_tensor(norm).detach().float().reshape(())
