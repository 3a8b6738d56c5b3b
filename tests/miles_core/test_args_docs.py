"""docs/args.md's "Shared flags" tables against miles-core's groups: the same groups in the same
order, under their class and module names, and in each the same flags in declaration order with
the `--no-` form, type and default each declares (rendered here, by the rules the page states),
and a Meaning that is the flag's help, word for word, at times followed by more detail."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

from miles_core.args import core_groups
from miles_core.args.flags import FLAG_METADATA_KEY, flag_kind

DOCS = Path(__file__).resolve().parents[2] / "docs" / "args.md"
HEADER = re.compile(r"^\*\*(.+)\*\* \(`(\w+)`, `([\w.]+)`\)$")
ROW = re.compile(r"^\| `(--[a-z0-9-]+)`( / `--no-[a-z0-9-]+`)? \| (.*?) \| (.*?) \| (.*) \|$")


def documented() -> list[tuple[str, str, list[tuple[str, bool, str, str, str]]]]:
    """``(class, module, rows)`` of each group of the section, rows as ``(flag, has --no-, type,
    default, meaning)``."""
    text = DOCS.read_text()
    section = text[text.index("\n## Shared flags\n") :]
    section = section.split("\n## ", 2)[1]  # up to the next heading
    found: list[tuple[str, str, list[tuple[str, bool, str, str, str]]]] = []
    for line in section.splitlines():
        if m := HEADER.match(line):
            found.append((m.group(2), m.group(3), []))
        elif (m := ROW.match(line)) and found:
            found[-1][2].append((m.group(1), bool(m.group(2)), m.group(3), m.group(4), m.group(5)))
    return found


def declared(group: type) -> list[tuple[str, bool, str, str]]:
    rows = []
    hints = typing.get_type_hints(group)
    for f in dataclasses.fields(group):
        meta = f.metadata.get(FLAG_METADATA_KEY)
        if meta is None:
            continue
        kind, base, optional, literal = flag_kind(hints[f.name])
        choices = meta.choices or literal
        if kind == "bool":
            kind_text = "bool (tri-state)" if optional else "bool"
        elif choices:
            kind_text = " \\| ".join(str(c) for c in choices)
        elif meta.metavar == "MODULE:FUNC":
            kind_text = "MODULE:FUNC"
        else:
            kind_text = base.__name__ if kind == "scalar" else f"list[{base.__name__}]"
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        rows.append(
            (
                "--" + f.name.replace("_", "-"),
                kind == "bool",
                kind_text,
                "unset" if default is None else f"`{default}`",
            )
        )
    return rows


def test_the_shared_flags_tables_are_the_core_groups():
    docs = documented()
    groups = core_groups()
    assert [(cls, module) for cls, module, _ in docs] == [
        (g.__name__, g.__module__) for g in groups
    ]
    for (cls, _, rows), group in zip(docs, groups, strict=True):
        # a default the page explains further keeps its first word ("unset (bf16)")
        assert [(o, no, t, d.split(" (")[0]) for o, no, t, d, _ in rows] == declared(group), cls
        helps = {
            "--" + f.name.replace("_", "-"): f.metadata[FLAG_METADATA_KEY].help
            for f in dataclasses.fields(group)
        }
        for option, _, _, _, meaning in rows:
            meaning = meaning.replace("\\|", "|")  # a table cell escapes the pipe
            help_text = helps[option]
            assert meaning == help_text or meaning.startswith(help_text + " "), (
                f"{option}: the Meaning column starts with the flag's help, word for word\n"
                f"  help:    {help_text}\n  Meaning: {meaning}"
            )
    assert sum(len(rows) for _, _, rows in docs) > 100  # the walk read the tables
