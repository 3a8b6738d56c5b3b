"""Small range checks shared by the groups' ``validate`` hooks; each error names the flag."""

from __future__ import annotations

from typing import Any

from miles_core.args.flags import ArgumentError
from miles_core.args.parsed import ParsedArgs


def option(dest: str) -> str:
    """``"offload_train"`` -> ``"--offload-train"``."""
    return "--" + dest.replace("_", "-")


def flag_value(args: ParsedArgs, dest: str) -> Any:
    """The parsed value of the flag ``dest`` (``--offload-train`` -> ``"offload_train"``), for
    the hooks' loops over flag names; a name no parsed group declares is a ``KeyError``."""
    return vars(args)[dest]


def launch_world_size(args: ParsedArgs) -> int | None:
    """The trainer's world size from the launcher's flags; None when the parse has no
    launcher group (the backend's ranks started by other means)."""
    if "actor_num_nodes" not in args:  # the launcher's group was not parsed
        return None
    nodes, per_node = args.actor_num_nodes, args.actor_num_gpus_per_node
    return nodes * per_node if nodes and per_node else None  # 0: the launcher's check says so


def at_least(args: ParsedArgs, dest: str, minimum: float) -> None:
    """``args.<dest> >= minimum`` (``None`` = unset passes)."""
    value = flag_value(args, dest)
    if value is not None and value < minimum:
        raise ArgumentError(f"{option(dest)} must be >= {minimum}, got {value}")


def greater_than(args: ParsedArgs, dest: str, bound: float) -> None:
    """``args.<dest> > bound`` (``None`` = unset passes)."""
    value = flag_value(args, dest)
    if value is not None and not value > bound:
        raise ArgumentError(f"{option(dest)} must be > {bound}, got {value}")


def within(args: ParsedArgs, dest: str, low: float, high: float) -> None:
    """``low <= args.<dest> <= high`` (``None`` = unset passes)."""
    value = flag_value(args, dest)
    if value is not None and not low <= value <= high:
        raise ArgumentError(f"{option(dest)} must be in [{low}, {high}], got {value}")


def requires(args: ParsedArgs, dest: str, needed: str, *, why: str = "") -> None:
    """When ``args.<dest>`` is set (truthy), ``args.<needed>`` must be set too."""
    if flag_value(args, dest) and not flag_value(args, needed):
        suffix = f" ({why})" if why else ""
        raise ArgumentError(f"{option(dest)} requires {option(needed)}{suffix}")


def exclusive(args: ParsedArgs, first: str, second: str, *, first_label: str | None = None) -> None:
    """``args.<first>`` and ``args.<second>`` are not both set (truthy)."""
    if flag_value(args, first) and flag_value(args, second):
        label = first_label or option(first)
        raise ArgumentError(f"{label} and {option(second)} are mutually exclusive")
