"""AdamW, the learning-rate schedule and gradient clipping over FSDP2 (DTensor) parameters.

Schedule (``lr_at(step)``, ``step`` counts optimizer steps from 0):

* warmup, ``step < warmup``: ``lr * (step + 1) / warmup``;
* after warmup, with ``t = min(1, (step - warmup) / max(1, decay_iters - warmup))``:
  ``constant``: ``lr``; ``linear``: ``min_lr + (lr - min_lr) * (1 - t)``;
  ``cosine``: ``min_lr + (lr - min_lr) * (1 + cos(pi * t)) / 2``.

``decay_iters`` unset (no ``--lr-decay-iters`` and no known run length) falls back to the warmup
length, so ``linear``/``cosine`` then decay to ``min_lr`` right after warmup.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    lr_warmup_iters: int = 0
    lr_decay_style: str = "constant"
    lr_decay_iters: int | None = None


def lr_at(step: int, cfg: OptimizerConfig) -> float:
    """The learning rate of optimizer step ``step`` (see the module docstring)."""
    if cfg.lr_decay_style not in DECAY_STYLES:
        raise ValueError(
            f"--lr-decay-style must be one of {DECAY_STYLES}, got {cfg.lr_decay_style!r}"
        )
    warmup = cfg.lr_warmup_iters
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    decay_iters = cfg.lr_decay_iters if cfg.lr_decay_iters is not None else warmup
    t = min(1.0, (step - warmup) / max(1, decay_iters - warmup))
    if cfg.lr_decay_style == "linear":
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * (1.0 - t)
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))


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
        optimizer, lambda step: lr_at(step, cfg) / cfg.lr if cfg.lr else 0.0
    )


def build_streamed_optimizer(
    model: nn.Module, cfg: OptimizerConfig, args: Any
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """``--stream-optimizer-state-to-disk``: miles-offload's streamed AdamW plus the same schedule.

    Masters and moments of the parameters with at least ``--stream-optimizer-min-numel``
    elements live in bucket files under ``--offload-train-disk-dir``; the arithmetic (and the
    fused / foreach choice) is that of :func:`build_optimizer`, so with fp32 moments the
    weights are bit-identical. Hyperparameters come from ``cfg`` like the in-memory AdamW's.
    """
    from miles_offload.streamed_adam import StreamedAdamConfig, StreamedAdamW

    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    on_cuda = bool(params) and all(p.device.type == "cuda" for _, p in params)
    config = StreamedAdamConfig(
        disk_dir=args.offload_train_disk_dir,
        moment_dtype=args.stream_optimizer_state_moment_dtype,
        bucket_numel=args.stream_optimizer_bucket_numel,
        min_numel=args.stream_optimizer_min_numel,
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
    from miles_offload.streamed_adam import StreamedAdamW

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
