"""The three ``--help`` forms of a command built from argument groups (docs/args.md):

* ``--help`` (``-h``): one screen, each group's title and its common flags (``flag(common=True)``),
  then how to see the rest;
* ``--help GROUP`` (``--help=GROUP``): every flag of one group, with its help and default;
  GROUP is the group's :func:`group_help_name` (or its title);
* ``--help-all``: every flag of every group.

:func:`miles_core.args.parse_args` answers them before it reads anything else (no ``--config``
file, no hook), so a help screen imports nothing the groups' modules do not.
"""

from __future__ import annotations

import re
import shutil
import textwrap
from collections.abc import Sequence
from typing import NamedTuple

from miles_core.args.flags import ArgGroup, ArgumentError, group_flags

HELP_FLAGS = ("-h", "--help")
HELP_ALL = "--help-all"


class HelpRequest(NamedTuple):
    """What a command line asks of the help: ``form`` is ``short``, ``group`` or ``all``."""

    form: str
    group: str | None = None


def help_request(argv: Sequence[str]) -> HelpRequest | None:
    """The first help flag of ``argv``: ``--help`` (a following word that is no flag is the
    GROUP), ``--help=GROUP``, ``--help-all``; ``None`` without one."""
    for i, arg in enumerate(argv):
        if arg == HELP_ALL:
            return HelpRequest("all")
        if arg.startswith("--help="):
            return HelpRequest("group", arg.split("=", 1)[1])
        if arg in HELP_FLAGS:
            following = argv[i + 1] if i + 1 < len(argv) else None
            if following is not None and not following.startswith("-"):
                return HelpRequest("group", following)
            return HelpRequest("short")
    return None


def kebab_case(name: str) -> str:
    """``DebugData`` -> ``debug-data``, ``FSDP`` -> ``fsdp``, ``DDPConfig`` -> ``ddp-config``."""
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1-\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1-\2", name).lower()


def group_help_name(group: type[ArgGroup]) -> str:
    """``help_name``, else the class name in kebab case less ``Args`` (``DebugDataArgs`` ->
    ``debug-data``, ``FSDPArgs`` -> ``fsdp``)."""
    return group.help_name or kebab_case(group.__name__.removesuffix("Args"))


def find_group(groups: Sequence[type[ArgGroup]], wanted: str) -> type[ArgGroup]:
    """The group named ``wanted`` (its help name or its title, any case); an unknown name is an
    :class:`ArgumentError` listing the names."""
    for group in groups:
        if wanted.lower() in (group_help_name(group), group.title.lower()):
            return group
    names = ", ".join(group_help_name(g) for g in groups)
    raise ArgumentError(f"--help {wanted}: no such group (groups: {names})")


def _width() -> int:
    return max(40, min(shutil.get_terminal_size().columns, 100) - 2)


def short_help(
    groups: Sequence[type[ArgGroup]], usage: str, notes: Sequence[str], prog: str
) -> str:
    """The one-screen ``--help``: ``usage``, then per group its help name, title and common
    flags (a group without one: how many flags it has), then ``notes`` (paragraphs)."""
    width = _width()
    total = sum(len(group_flags(g)) for g in groups)
    lines = [usage, ""]
    lines += textwrap.wrap(
        f"Common flags by group. `{prog} --help GROUP` lists every flag of one group with its "
        f"help and default; `{prog} --help-all` lists all {total} flags.",
        width,
    )
    lines.append("")
    for group in groups:
        specs = group_flags(group)
        common = [spec.option for spec in specs if spec.meta.common]
        head = f"{group_help_name(group)}: {group.title or group.__name__}"
        if not common:
            lines.append(f"{head} ({len(specs)} flag{'s' if len(specs) != 1 else ''})")
            continue
        lines.append(head)
        lines += textwrap.wrap(
            " ".join(common),
            width,
            initial_indent="  ",
            subsequent_indent="  ",
            break_on_hyphens=False,
            break_long_words=False,
        )
    lines.append("")
    for note in notes:
        lines += textwrap.wrap(note, width, break_on_hyphens=False, break_long_words=False)
    return "\n".join(lines) + "\n"
