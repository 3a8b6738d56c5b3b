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
from miles_core.args.groups import OffloadArgs, OptimizerArgs
from miles_core.args.parsed import ParsedArgs


@dataclass(frozen=True)
class StreamedStateConfig:
    """``--stream-optimizer-state-to-disk``: where and how the fp32 masters and Adam moments
    live in files (miles-offload's ``StreamedAdamConfig`` takes these fields); the defaults are
    the offload group's."""

    disk_dir: str | None
    moment_dtype: str
    bucket_numel: int
    min_numel: int


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW hyperparameters and the LR schedule of one trained model (actor or critic), made
    by :func:`optimizer_config` from the optimizer group (its defaults and domains)."""

    lr: float
    min_lr: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    clip_grad: float
    lr_warmup_iters: int
    #: one of the choices of ``--lr-decay-style``
    lr_decay_style: str
    #: resolved: ``--lr-decay-iters``, else the run's optimizer steps; None only for constant
    lr_decay_iters: int | None
    #: None unless --stream-optimizer-state-to-disk
    streamed: StreamedStateConfig | None = None

    def __post_init__(self) -> None:
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
        assert self.lr_decay_iters is not None  # __post_init__
        t = min(1.0, (step - warmup) / max(1, self.lr_decay_iters - warmup))
        if self.lr_decay_style == "linear":
            return floor + (peak - floor) * (1.0 - t)
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * t))


def lr_at(step: int, cfg: OptimizerConfig) -> float:
    """``cfg.lr_at(step)``."""
    return cfg.lr_at(step)


def run_optimizer_steps(args: ParsedArgs) -> int | None:
    """The optimizer steps of the whole run, ``--num-rollout`` x ``--num-steps-per-rollout``,
    or None where the launcher's ``--num-rollout`` is not parsed (ranks under torchrun)."""
    num_rollout = args.num_rollout if "num_rollout" in args else None  # the launcher's flag
    if not num_rollout:
        return None
    return num_rollout * args.run_config.algorithm.num_steps_per_rollout


def streamed_state_config(offload: OffloadArgs) -> StreamedStateConfig | None:
    """The streamed-optimizer settings, or None without --stream-optimizer-state-to-disk."""
    if not offload.stream_optimizer_state_to_disk:
        return None
    return StreamedStateConfig(
        disk_dir=offload.offload_train_disk_dir,
        moment_dtype=offload.stream_optimizer_state_moment_dtype,
        bucket_numel=offload.stream_optimizer_bucket_numel,
        min_numel=offload.stream_optimizer_min_numel,
    )


def optimizer_config(
    optimizer: OptimizerArgs, offload: OffloadArgs, run_steps: int | None = None
) -> OptimizerConfig:
    """The optimizer, schedule and streamed-state settings of the parsed groups (both
    backends): ``optimizer_config(cfg.optimizer, cfg.offload, run_optimizer_steps(args))``
    with ``cfg = args.run_config``. ``run_steps`` is the decay span when ``--lr-decay-iters``
    is unset (:func:`run_optimizer_steps`).

    For the critic, pass the groups of ``critic_args(args).run_config`` (its ``--critic-lr``,
    ...).
    """
    decay = optimizer.lr_decay_iters if optimizer.lr_decay_iters is not None else run_steps
    return OptimizerConfig(
        lr=optimizer.lr,
        min_lr=optimizer.min_lr,
        weight_decay=optimizer.weight_decay,
        adam_beta1=optimizer.adam_beta1,
        adam_beta2=optimizer.adam_beta2,
        adam_eps=optimizer.adam_eps,
        clip_grad=optimizer.clip_grad,
        lr_warmup_iters=optimizer.lr_warmup_iters,
        lr_decay_style=optimizer.lr_decay_style,
        lr_decay_iters=decay,
        streamed=streamed_state_config(offload),
    )
