"""The help of the console scripts: ``miles train --help`` fits one screen (each group's common
flags, then how to see the rest), ``--help GROUP`` is one group in full, ``--help-all`` every flag;
``miles-sync --help`` names its commands and ``miles-sync pull --help-all`` lists exactly the flags
the puller reads. All of them in one fresh interpreter (one process for the file), which must not
have imported torch, megatron, ray or transformers by the end.

The references are independent of the help code: the flags are the groups' dataclass fields
(``dataclasses.fields``), and what ``miles-sync pull`` reads is found in its source (``ast``).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
import subprocess
import sys
import textwrap

import miles_sync.cli as sync_cli
import pytest
from miles_core import backends
from miles_core.args import entry_point_groups, group_help_name

PROBE = """
import contextlib, io, json, sys, time
from miles_launch.cli import main as miles
from miles_sync.cli import main as miles_sync

results = []
for line in sys.stdin.read().splitlines():
    command, *argv = json.loads(line)
    out, err = io.StringIO(), io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = (miles if command == "miles" else miles_sync)(argv) or 0
        except SystemExit as exit:
            code = exit.code
    took = time.perf_counter() - started
    results.append({"code": code, "out": out.getvalue(), "err": err.getvalue(), "s": took})
heavy = sorted(m for m in ("torch", "megatron", "ray", "transformers") if m in sys.modules)
print(json.dumps({"results": results, "heavy": heavy}))
"""

FLAG_LINE = re.compile(r"^  (?:-h \[GROUP\], )?(--[A-Za-z0-9-]+)")  # argparse's invocation column


def options(group: type) -> set[str]:
    """The group's flags, from its dataclass fields (booleans also take ``--no-``)."""
    return {"--" + field.name.replace("_", "-") for field in dataclasses.fields(group)}


def listed(text: str) -> set[str]:
    """The flags an argparse help lists (first option string of each entry)."""
    return {m.group(1) for line in text.splitlines() if (m := FLAG_LINE.match(line))}


@pytest.fixture(scope="module")
def helps():
    """``run(command, *argv)`` -> the result of that command line in the probe's process."""
    if "fsdp" not in backends.available() or "megatron" not in backends.available():
        pytest.skip("both backends must be installed")
    megatron = entry_point_groups("core", "megatron", "launch")
    fsdp = entry_point_groups("core", "fsdp", "launch")
    names = {group: group_help_name(group) for group in {*megatron, *fsdp}}
    calls = [
        ["miles", "train", "--help"],
        ["miles", "train", "--train-backend", "fsdp", "--help"],
        ["miles", "train", "--help-all"],
        ["miles", "train", "--help", "nosuch"],
        ["miles", "train", "--help", "fsdp"],  # FSDP's group, megatron selected
        *(["miles", "train", "--help", names[g]] for g in megatron),
        ["miles", "train", "--train-backend", "fsdp", "--help=fsdp"],
        ["miles", "train", "--gradient-checkpointing"],  # FSDP's flag, megatron by default
        ["miles", "train", "--train-backend", "fsdp", "--recompute-granularity", "full"],
        ["miles", "train", "--train-backend", "fsdp", "--recompute-granularityy", "full"],
        ["miles-sync", "--help"],
        ["miles-sync", "pull", "--help"],
        ["miles-sync", "pull", "--help-all"],
    ]
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        input="\n".join(json.dumps(c) for c in calls),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    by_call = {tuple(c): r for c, r in zip(calls, report["results"], strict=True)}
    return {"run": lambda *c: by_call[c], "heavy": report["heavy"], "names": names,
            "megatron": megatron, "fsdp": fsdp}  # fmt: skip


def test_short_help_fits_one_screen_and_names_every_group(helps):
    for backend in ("megatron", "fsdp"):
        argv = ("miles", "train", "--help")
        if backend == "fsdp":
            argv = ("miles", "train", "--train-backend", "fsdp", "--help")
        shown = helps["run"](*argv)
        assert shown["code"] == 0 and shown["err"] == ""
        lines = shown["out"].splitlines()
        assert lines[0] == "usage: miles train [flags]"
        assert len(lines) <= 60, len(lines)
        for group in helps[backend]:
            head = f"{helps['names'][group]}: {group.title}"
            assert any(line.startswith(head) for line in lines), head
            common = [f.name for f in dataclasses.fields(group) if f.metadata["miles_flag"].common]
            for name in common:
                assert "--" + name.replace("_", "-") in shown["out"].split(), name
        text = " ".join(shown["out"].split())
        assert "`miles train --help GROUP` lists every flag of one group" in text
        total = sum(len(dataclasses.fields(g)) for g in helps[backend])
        assert f"`miles train --help-all` lists all {total} flags" in text
        assert "--train-backend fsdp adds fsdp;" in text
        assert "--train-backend megatron adds megatron, architecture, transformer-config" in text
    # the flags a new user writes are on it (the getting-started job)
    for name in ("--hf-checkpoint", "--prompt-data", "--rm-type", "--colocate", "--lr", "--save"):
        assert name in helps["run"]("miles", "train", "--help")["out"].split()


def test_help_group_lists_that_group_and_no_other(helps):
    for group in helps["megatron"]:
        shown = helps["run"]("miles", "train", "--help", helps["names"][group])
        assert shown["code"] == 0 and shown["err"] == ""
        assert listed(shown["out"]) == options(group), group.__name__
    (fsdp_group,) = [g for g in helps["fsdp"] if g.__name__ == "FSDPArgs"]
    shown = helps["run"]("miles", "train", "--train-backend", "fsdp", "--help=fsdp")
    assert shown["code"] == 0 and listed(shown["out"]) == options(fsdp_group)


def test_help_all_lists_every_flag(helps):
    shown = helps["run"]("miles", "train", "--help-all")
    assert shown["code"] == 0
    every = set().union(*(options(g) for g in helps["megatron"]))
    assert listed(shown["out"]) == every | {"--help", "--help-all", "--config"}


def test_an_unknown_group_is_one_line_naming_the_groups(helps):
    shown = helps["run"]("miles", "train", "--help", "nosuch")
    assert shown["code"] == 2 and shown["out"] == ""
    names = ", ".join(helps["names"][g] for g in helps["megatron"])
    assert shown["err"].splitlines() == [f"error: --help nosuch: no such group (groups: {names})"]
    # a group of the backend not selected: which --train-backend adds it
    shown = helps["run"]("miles", "train", "--help", "fsdp")
    assert shown["code"] == 2
    assert shown["err"].splitlines() == [
        "error: --help fsdp: a group of --train-backend fsdp "
        "(`miles train --train-backend fsdp --help fsdp`)"
    ]


def test_another_backends_flag_is_one_line_naming_both_backends(helps):
    """A flag only the other installed backend declares names that backend and this job's
    (before any import of torch: test_no_help_imported_torch_megatron_or_ray's probe ran it);
    a misspelt one keeps the did-you-mean."""
    shown = helps["run"]("miles", "train", "--gradient-checkpointing")
    assert shown["code"] == 2 and shown["out"] == ""
    assert shown["err"].splitlines() == [
        "error: --gradient-checkpointing is a flag of --train-backend fsdp, not of "
        "--train-backend megatron (this job's backend)"
    ]
    shown = helps["run"](
        "miles", "train", "--train-backend", "fsdp", "--recompute-granularity", "full"
    )
    assert shown["code"] == 2
    assert shown["err"].splitlines() == [
        "error: --recompute-granularity is a flag of --train-backend megatron, not of "
        "--train-backend fsdp (this job's backend)"
    ]
    shown = helps["run"](
        "miles", "train", "--train-backend", "fsdp", "--recompute-granularityy", "full"
    )
    assert shown["code"] == 2
    assert shown["err"].splitlines() == ["error: unrecognized flag --recompute-granularityy"]


def _pull_reads() -> set[str]:
    """The ``args.X`` that ``miles-sync pull`` reads: in ``main`` and the flags' own checks."""
    functions = (sync_cli.main, sync_cli.PullArgs.validate)
    trees = [ast.parse(textwrap.dedent(inspect.getsource(f))) for f in functions]
    return {
        "--" + node.attr.replace("_", "-")
        for tree in trees
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "args"
    }


def test_miles_sync_help_names_its_commands_and_pull_only_its_flags(helps):
    shown = helps["run"]("miles-sync", "--help")
    assert shown["code"] == 0 and shown["err"] == ""
    assert shown["out"].startswith("usage: miles-sync <command> [flags]")
    assert re.search(r"^  pull  ", shown["out"], re.M)
    short = helps["run"]("miles-sync", "pull", "--help")
    assert short["code"] == 0 and short["out"].startswith("usage: miles-sync pull [flags]")
    assert "--sglang-" not in short["out"]  # pull passes nothing to an engine
    full = helps["run"]("miles-sync", "pull", "--help-all")
    assert full["code"] == 0
    reads = _pull_reads()
    assert len(reads) == 5, reads
    assert listed(full["out"]) == reads | {"--help", "--help-all", "--config"}


def test_no_help_imported_torch_megatron_or_ray(helps):
    assert helps["heavy"] == []
    # each help takes well under a second once the interpreter runs (reported, not timed)
    assert helps["run"]("miles", "train", "--help")["s"] < 10
