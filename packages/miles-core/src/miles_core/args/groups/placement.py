"""Placement flags the shared checks depend on: ``--colocate`` and ``--train-backend``.

The launcher owns placement (Ray bundles, GPU counts, engines), but these two are read by checks
that belong to miles-core's own groups (offload defaults, weight-transfer mode) and by backends
started under plain ``torchrun`` without the launcher, so they are declared here once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from miles_core.args.flags import ArgGroup, ArgumentError, flag
from miles_core.backends import KNOWN_BACKENDS, available


@dataclass
class PlacementArgs(ArgGroup):
    title: ClassVar[str] = "placement (shared)"

    colocate: bool = flag(
        False,
        help="Put the engines on the trainer's GPUs; they take turns. Turns --offload-train and "
        "--offload-rollout on and publishes weights over IPC.",
    )
    train_backend: str = flag(
        "megatron",
        help="Training backend (an installed 'miles.backends' entry point: megatron or fsdp).",
    )

    @classmethod
    def validate(cls, args: Any) -> None:
        known = sorted(set(KNOWN_BACKENDS) | set(available()))
        if args.train_backend not in known:
            raise ArgumentError(
                f"argument --train-backend: invalid choice {args.train_backend!r} "
                f"(choose from {', '.join(known)})"
            )
