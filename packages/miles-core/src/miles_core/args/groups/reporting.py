"""Where a run's metrics are written, for every process that writes them.

``--tensorboard-dir`` is read by the launcher (per-rollout scalars: ``rollout/*``, ``train/*``,
``time/*``, ``eval/*``) and by the backends under plain ``torchrun`` too (the FSDP backend's
per-rank scalars and profiler traces), so it is declared here once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from miles_core.args.flags import ArgGroup, flag


@dataclass(frozen=True)
class ReportingArgs(ArgGroup):
    title: ClassVar[str] = "reporting (shared)"

    tensorboard_dir: str | None = flag(
        None,
        metavar="DIR",
        common=True,
        help="Write TensorBoard scalars (launcher: per rollout; backends: per rank) and "
        "profiler traces under this directory.",
    )
