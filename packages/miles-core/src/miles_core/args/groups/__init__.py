"""The shared argument groups of miles-core (DESIGN.md "Arguments: one owner per flag")."""

from __future__ import annotations

from miles_core.args.flags import ArgGroup
from miles_core.args.groups.algorithm import AlgorithmArgs
from miles_core.args.groups.checkpoint import CheckpointArgs
from miles_core.args.groups.critic import CriticArgs
from miles_core.args.groups.offload import OffloadArgs
from miles_core.args.groups.optimizer import OptimizerArgs
from miles_core.args.groups.parallel import ParallelArgs
from miles_core.args.groups.placement import PlacementArgs
from miles_core.args.groups.reporting import ReportingArgs
from miles_core.args.groups.roles import RolesArgs
from miles_core.args.groups.sync import SyncArgs

__all__ = [
    "AlgorithmArgs",
    "CheckpointArgs",
    "CriticArgs",
    "OffloadArgs",
    "OptimizerArgs",
    "ParallelArgs",
    "PlacementArgs",
    "ReportingArgs",
    "RolesArgs",
    "SyncArgs",
    "core_groups",
]


def core_groups() -> list[type[ArgGroup]]:
    """miles-core's shared groups, in ``--help`` order."""
    return [
        PlacementArgs,
        CheckpointArgs,
        OptimizerArgs,
        ParallelArgs,
        AlgorithmArgs,
        RolesArgs,
        CriticArgs,
        OffloadArgs,
        SyncArgs,
        ReportingArgs,
    ]
