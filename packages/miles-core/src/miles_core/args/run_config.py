"""The typed run configuration: one instance of each parsed group, built once after parsing.

:func:`miles_core.args.parse_args` resolves defaults, validates and checks paths on the flat
namespace, then builds a :class:`RunConfig` from it and attaches it as ``args.run_config``
(the only way code reaches it)::

    cfg = args.run_config
    cfg.optimizer.lr                 # miles-core's groups: typed properties
    cfg[FSDPArgs].dp_replicate_size  # any parsed group; an error naming it if not parsed
    cfg.get(LaunchArgs)              # None where the group may be absent (ranks under torchrun)

mypy sees every field's declared type (``tests/test_type_check.py``). The groups hold the values
the hooks resolved; a value a process changes later on the namespace (``--sglang-api-key``
generated when the engines start) is not reflected here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from miles_core.args.flags import ArgGroup
from miles_core.args.groups import (
    AlgorithmArgs,
    CheckpointArgs,
    CriticArgs,
    OffloadArgs,
    OptimizerArgs,
    ParallelArgs,
    PlacementArgs,
    ReportingArgs,
    RolesArgs,
    SyncArgs,
)

G = TypeVar("G", bound=ArgGroup)


def group_from_namespace(group: type[G], namespace: Any) -> G:
    """An instance of ``group`` holding the namespace's values of its fields."""
    values = vars(namespace)
    return group(**{f.name: values[f.name] for f in dataclasses.fields(group)})  # type: ignore[arg-type]


@dataclass(frozen=True)
class RunConfig:
    """The parsed groups (one instance each, in parse order) and the flags set explicitly (on
    the command line or in ``--config``)."""

    groups: tuple[ArgGroup, ...]
    explicit_flags: frozenset[str]

    @classmethod
    def from_namespace(cls, namespace: Any, groups: Iterable[type[ArgGroup]]) -> RunConfig:
        built = tuple(group_from_namespace(group, namespace) for group in groups)
        return cls(built, frozenset(namespace.explicit_flags))

    def rebuilt(self, namespace: Any) -> RunConfig:
        """The same groups, holding ``namespace``'s values (a namespace derived from the parsed
        one, such as :func:`~miles_core.args.groups.critic.critic_args`'s)."""
        return RunConfig.from_namespace(namespace, [type(g) for g in self.groups])

    def get(self, group: type[G]) -> G | None:
        """The parsed instance of ``group``, None where it was not parsed."""
        for found in self.groups:
            if type(found) is group:
                return found
        return None

    def __getitem__(self, group: type[G]) -> G:
        found = self.get(group)
        if found is None:
            parsed = ", ".join(sorted(type(g).__name__ for g in self.groups))
            raise KeyError(
                f"argument group {group.__name__} was not parsed in this process (parsed: {parsed})"
            )
        return found

    def __contains__(self, group: type[ArgGroup]) -> bool:
        return self.get(group) is not None

    @property
    def placement(self) -> PlacementArgs:
        return self[PlacementArgs]

    @property
    def checkpoint(self) -> CheckpointArgs:
        return self[CheckpointArgs]

    @property
    def optimizer(self) -> OptimizerArgs:
        return self[OptimizerArgs]

    @property
    def parallel(self) -> ParallelArgs:
        return self[ParallelArgs]

    @property
    def algorithm(self) -> AlgorithmArgs:
        return self[AlgorithmArgs]

    @property
    def roles(self) -> RolesArgs:
        return self[RolesArgs]

    @property
    def critic(self) -> CriticArgs:
        return self[CriticArgs]

    @property
    def offload(self) -> OffloadArgs:
        return self[OffloadArgs]

    @property
    def sync(self) -> SyncArgs:
        return self[SyncArgs]

    @property
    def reporting(self) -> ReportingArgs:
        return self[ReportingArgs]
