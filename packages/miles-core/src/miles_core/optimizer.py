"""The optimizer, its learning-rate schedule and the streamed-optimizer settings, from the flags.

Both training backends build their AdamW and schedule from :func:`optimizer_config`; the LR of
every optimizer step is :meth:`OptimizerConfig.lr_at` on both (FSDP through a ``LambdaLR``,
Megatron through its ``OptimizerParamScheduler`` whose ``get_lr`` is this function).

Schedule (``step`` counts optimizer steps from 0, ``W = --lr-warmup-iters``,
``D = --lr-decay-iters``):

* warmup, ``step < W``: ``lr * (step + 1) / W`` (the first step already trains);
* after warmup, with ``t = min(1, (step - W) / max(1, D - W))``:
  ``constant``: ``lr``; ``linear``: ``min_lr + (lr - min_lr) * (1 - t)``;
  ``cosine``: ``min_lr + (lr - min_lr) * (1 + cos(pi * t)) / 2``.

``--lr-decay-iters`` unset means the whole run: ``--num-rollout * --num-steps-per-rollout``
optimizer steps when the launcher's ``--num-rollout`` is in the flags. A decaying style with
neither is refused (the run length is unknown, so there is nothing to decay over).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from miles_core.args.flags import ArgumentError
from miles_core.args.parsed import ParsedArgs

DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class StreamedStateConfig:
    """``--stream-optimizer-state-to-disk``: where and how the fp32 masters and Adam moments
    live in files (miles-offload's ``StreamedAdamConfig`` takes these fields)."""

    disk_dir: str | None = None
    moment_dtype: str = "fp32"
    bucket_numel: int = 200_000_000
    min_numel: int = 65536


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW hyperparameters and the LR schedule of one trained model (actor or critic)."""

    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    lr_warmup_iters: int = 0
    lr_decay_style: str = "constant"
    #: resolved: ``--lr-decay-iters``, else the run's optimizer steps; None only for constant
    lr_decay_iters: int | None = None
    #: None unless --stream-optimizer-state-to-disk
    streamed: StreamedStateConfig | None = None

    def __post_init__(self) -> None:
        if self.lr_decay_style not in DECAY_STYLES:
            raise ArgumentError(
                f"--lr-decay-style must be one of {DECAY_STYLES}, got {self.lr_decay_style!r}"
            )
        if self.lr_decay_style != "constant" and self.lr_decay_iters is None:
            raise ArgumentError(
                f"--lr-decay-style {self.lr_decay_style} needs --lr-decay-iters: the run length "
                "is not known here (no --num-rollout)"
            )

    def lr_at(self, step: int, lr: float | None = None, min_lr: float | None = None) -> float:
        """The learning rate of optimizer step ``step`` (see the module docstring); ``lr`` /
        ``min_lr`` replace the peak and floor (a parameter group with its own)."""
        peak = self.lr if lr is None else lr
        floor = self.min_lr if min_lr is None else min_lr
        warmup = self.lr_warmup_iters
        if step < warmup:
            return peak * (step + 1) / warmup
        if self.lr_decay_style == "constant":
            return peak
        t = min(1.0, (step - warmup) / max(1, self.lr_decay_iters - warmup))
        if self.lr_decay_style == "linear":
            return floor + (peak - floor) * (1.0 - t)
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * t))


def lr_at(step: int, cfg: OptimizerConfig) -> float:
    """``cfg.lr_at(step)``."""
    return cfg.lr_at(step)


def decay_iters(args: ParsedArgs) -> int | None:
    """``--lr-decay-iters``, else the whole run when known (``--num-rollout`` x
    ``--num-steps-per-rollout``), else None."""
    if args.lr_decay_iters is not None:
        return args.lr_decay_iters
    # --num-rollout is the launcher's: unknown where its group is not parsed (ranks under torchrun)
    num_rollout = args.num_rollout if "num_rollout" in args else None
    if num_rollout:
        return num_rollout * args.num_steps_per_rollout
    return None


def streamed_state_config(args: ParsedArgs) -> StreamedStateConfig | None:
    """The streamed-optimizer settings, or None without --stream-optimizer-state-to-disk."""
    if not args.stream_optimizer_state_to_disk:
        return None
    return StreamedStateConfig(
        disk_dir=args.offload_train_disk_dir,
        moment_dtype=args.stream_optimizer_state_moment_dtype,
        bucket_numel=args.stream_optimizer_bucket_numel,
        min_numel=args.stream_optimizer_min_numel,
    )


def optimizer_config(args: ParsedArgs) -> OptimizerConfig:
    """The optimizer, schedule and streamed-state part of the parsed flags (both backends).

    For the critic, pass ``critic_args(args)`` (its ``--critic-lr``, ...).
    """
    return OptimizerConfig(
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        lr_warmup_iters=args.lr_warmup_iters,
        lr_decay_style=args.lr_decay_style,
        lr_decay_iters=decay_iters(args),
        streamed=streamed_state_config(args),
    )
