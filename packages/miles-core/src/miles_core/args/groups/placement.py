"""Placement flags the shared checks depend on: ``--colocate`` and ``--train-backend``.

The launcher owns placement (Ray bundles, GPU counts, engines), but these two are read by checks
that belong to miles-core's own groups (offload defaults, weight-transfer mode) and by backends
started under plain ``torchrun`` without the launcher, so they are declared here once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import yaml

from miles_core.args.config_file import convert_config_value, find_config_path
from miles_core.args.flags import ArgGroup, ArgumentError, flag, group_flags
from miles_core.args.parsed import ParsedArgs
from miles_core.backends import KNOWN_BACKENDS, available


@dataclass(frozen=True)
class PlacementArgs(ArgGroup):
    title: ClassVar[str] = "placement (shared)"

    colocate: bool = flag(
        False,
        common=True,
        help="Put the engines on the trainer's GPUs; they take turns. Turns --offload-train and "
        "--offload-rollout on and publishes weights over IPC.",
    )
    train_backend: str = flag(
        "megatron",
        common=True,
        help="Training backend (an installed 'miles.backends' entry point: megatron or fsdp).",
    )

    @classmethod
    def validate(cls, args: ParsedArgs) -> None:
        known = sorted(set(KNOWN_BACKENDS) | set(available()))
        if args.train_backend not in known:
            raise ArgumentError(
                f"argument --train-backend: invalid choice {args.train_backend!r} "
                f"(choose from {', '.join(known)})"
            )


def selected_backend(argv: list[str]) -> str:
    """``--train-backend`` before full parsing, so the launcher knows which groups to compose.

    Reads ``--train-backend X`` / ``--train-backend=X`` from ``argv`` (the last one, as argparse
    does: a later flag wins), else the ``--config`` YAML's ``train-backend`` / ``train_backend``
    key, else the default. The value is checked later by :meth:`PlacementArgs.validate` as part
    of the full parse.
    """
    found = None
    for i, token in enumerate(argv):
        if token == "--train-backend" and i + 1 < len(argv):
            found = argv[i + 1]
        elif token.startswith("--train-backend="):
            found = token.split("=", 1)[1]
    if found is not None:
        return found
    config_path = find_config_path(argv)
    if config_path is not None:
        specs = {spec.dest: spec for spec in group_flags(PlacementArgs)}
        try:
            data = yaml.safe_load(Path(config_path).read_text())
        except (OSError, yaml.YAMLError):
            data = None  # the full parse reports the file's problem
        if isinstance(data, dict):
            for key in ("train-backend", "train_backend"):
                if key in data:
                    where = f"--config {config_path}: key '{key}'"
                    return convert_config_value(specs["train_backend"], data[key], where)
    return PlacementArgs.train_backend
