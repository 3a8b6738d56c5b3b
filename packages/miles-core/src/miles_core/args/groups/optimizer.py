"""Optimizer (AdamW), learning-rate schedule and precision flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from miles_core.args.checks import at_least, exclusive, flag_value, greater_than, within
from miles_core.args.flags import ArgGroup, ArgumentError, flag
from miles_core.args.parsed import ParsedArgs


@dataclass(frozen=True)
class OptimizerArgs(ArgGroup):
    title: ClassVar[str] = "optimizer and precision"

    lr: float = flag(1e-6, common=True, help="Peak learning rate.")
    min_lr: float = flag(0.0, help="Learning rate at the end of the decay.")
    lr_warmup_iters: int = flag(
        0, common=True, help="Optimizer steps of linear warmup from 0 to --lr."
    )
    lr_decay_style: Literal["constant", "cosine", "linear"] = flag(
        "constant", common=True, help="Decay from --lr to --min-lr after warmup."
    )
    lr_decay_iters: int | None = flag(
        None,
        help="Optimizer steps over which the LR decays (unset: the whole run, when known).",
    )
    weight_decay: float = flag(0.01, common=True, help="AdamW decoupled weight decay.")
    adam_beta1: float = flag(0.9, help="AdamW beta1.")
    adam_beta2: float = flag(0.999, help="AdamW beta2.")
    adam_eps: float = flag(1e-8, help="AdamW epsilon.")
    clip_grad: float = flag(
        1.0, common=True, help="Clip the global gradient norm to this value (0: off)."
    )
    fp16: bool = flag(False, help="Train in fp16 (with loss scaling, see --loss-scale).")
    loss_scale: float | None = flag(
        None, help="fp16: a fixed loss scale (unset: dynamic scaling from --initial-loss-scale)."
    )
    initial_loss_scale: float = flag(2.0**32, help="fp16: the dynamic loss scale's start.")
    min_loss_scale: float = flag(1.0, help="fp16: the dynamic loss scale's floor.")
    loss_scale_window: int = flag(
        1000, metavar="N", help="fp16: double the dynamic scale after N steps without overflow."
    )
    hysteresis: int = flag(
        2, metavar="N", help="fp16: overflowing steps tolerated before the scale is halved."
    )
    bf16: bool | None = flag(
        None,
        help="Compute in bf16 (the default on every backend; --no-bf16: fp32 unless --fp16). "
        "Master weights and optimizer state stay fp32.",
    )
    seed: int = flag(1234, help="Random seed.")

    @classmethod
    def validate(cls, args: ParsedArgs) -> None:
        exclusive(args, "fp16", "bf16")
        at_least(args, "lr", 0.0)
        at_least(args, "min_lr", 0.0)
        if args.min_lr > args.lr:
            raise ArgumentError(f"--min-lr ({args.min_lr}) must not exceed --lr ({args.lr})")
        at_least(args, "lr_warmup_iters", 0)
        at_least(args, "lr_decay_iters", 1)
        at_least(args, "weight_decay", 0.0)
        for dest in ("loss_scale", "initial_loss_scale", "min_loss_scale"):
            greater_than(args, dest, 0.0)
        at_least(args, "loss_scale_window", 1)
        at_least(args, "hysteresis", 1)
        for dest in ("adam_beta1", "adam_beta2"):
            within(args, dest, 0.0, 1.0)
            if flag_value(args, dest) == 1.0:
                raise ArgumentError(f"--{dest.replace('_', '-')} must be < 1")
        greater_than(args, "adam_eps", 0.0)
        at_least(args, "clip_grad", 0.0)
