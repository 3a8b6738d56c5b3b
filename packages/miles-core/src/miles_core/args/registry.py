"""Finding argument groups of installed packages through the ``miles.arg_groups`` entry points.

Each entry point names either an :class:`ArgGroup` subclass or a callable returning a list of them::

    [project.entry-points."miles.arg_groups"]
    fsdp = "miles_fsdp.args:fsdp_groups"
"""

from __future__ import annotations

from importlib.metadata import entry_points

from miles_core.args.flags import ArgGroup

ENTRY_POINT_GROUP = "miles.arg_groups"


def groups_of_entry_point(name: str, target: object) -> list[type[ArgGroup]]:
    """The groups an entry point's loaded object stands for."""
    if isinstance(target, type) and issubclass(target, ArgGroup):
        return [target]
    if callable(target):
        groups = list(target())
        for group in groups:
            if not (isinstance(group, type) and issubclass(group, ArgGroup)):
                raise TypeError(f"entry point '{name}' returned {group!r}, not an ArgGroup")
        return groups
    raise TypeError(f"entry point '{name}' is neither an ArgGroup nor a callable returning groups")


def installed_groups() -> list[type[ArgGroup]]:
    """Every group of every installed package (each once), sorted by entry point name."""
    found: list[type[ArgGroup]] = []
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        for group in groups_of_entry_point(ep.name, ep.load()):
            if group not in found:
                found.append(group)
    return found
