"""Finding argument groups of installed packages through the ``miles.arg_groups`` entry points.

Each entry point names either an :class:`ArgGroup` subclass or a callable returning a list of them::

    [project.entry-points."miles.arg_groups"]
    fsdp = "miles_fsdp.args:fsdp_groups"

Convention: a backend's entry point has the backend's name (``fsdp``, ``megatron``, as in
``miles.backends``), miles-core's is ``core`` and the launcher's ``launch``, so the launcher loads
only ``entry_point_groups("core", args.train_backend, "launch")`` and never imports the other
backend.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from miles_core.args.flags import ArgGroup, ArgumentError

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


def _add(found: list[type[ArgGroup]], groups: list[type[ArgGroup]]) -> None:
    for group in groups:
        if group not in found:
            found.append(group)


def installed_groups() -> list[type[ArgGroup]]:
    """Every group of every installed package (each once), sorted by entry point name."""
    found: list[type[ArgGroup]] = []
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        _add(found, groups_of_entry_point(ep.name, ep.load()))
    return found


def entry_point_groups(*names: str) -> list[type[ArgGroup]]:
    """The groups of the named entry points, in the order given; only those are imported.

    A name no installed package provides is an :class:`ArgumentError` listing the installed ones.
    """
    by_name = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    found: list[type[ArgGroup]] = []
    for name in names:
        if name not in by_name:
            known = ", ".join(sorted(by_name))
            raise ArgumentError(
                f"no installed package declares argument groups '{name}' (installed: {known})"
            )
        _add(found, groups_of_entry_point(name, by_name[name].load()))
    return found
