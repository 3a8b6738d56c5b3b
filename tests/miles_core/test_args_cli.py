"""The CLI contract: exit status 2 with one stderr line, hook order, and one owner per flag."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
from miles_core.args import (
    ArgGroup,
    ArgumentError,
    collect_flags,
    core_groups,
    entry_point_groups,
    flag,
    installed_groups,
    make_group,
    parse_args,
    selected_backend,
)
from miles_core.args.groups import CheckpointArgs, OptimizerArgs
from miles_core.args.registry import groups_of_entry_point

SCRIPT = (
    "import sys; from miles_core.args import core_groups, parse_args_or_exit; "
    "a = parse_args_or_exit(sys.argv[1:], core_groups()); print('ok', a.lr)"
)


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, *argv], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--lr", "fast"], "error: argument --lr: invalid float value: 'fast'"),
        (["--no-such-flag"], "error: unrecognized flag --no-such-flag"),
        (["--lrr", "1"], "error: unrecognized flag --lrr (did you mean --lr?)"),
        (["--fp16", "--bf16"], "error: --fp16 and --bf16 are mutually exclusive"),
        (
            ["--save-trigger-sentinel", "/tmp/x"],
            "error: --save-trigger-sentinel requires --save",
        ),
        (
            ["--hf-checkpoint", "/does/not/exist"],
            "error: --hf-checkpoint /does/not/exist: no such directory",
        ),
    ],
)
def test_exit_status_2_and_one_line(argv, line):
    proc = run_cli(*argv)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [line]


def test_good_command_line_exits_normally(tmp_path):
    proc = run_cli("--lr", "2e-6", "--hf-checkpoint", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok 2e-06"


def test_help_all_lists_every_flag():
    proc = run_cli("--help-all")
    assert proc.returncode == 0
    for spec in collect_flags(core_groups()).values():
        assert spec.option in proc.stdout


def test_combination_errors_come_before_path_errors(tmp_path):
    missing = str(tmp_path / "missing")
    # a file-missing problem and a flag-combination problem: the combination is reported
    with pytest.raises(ArgumentError, match="--fp16 and --bf16 are mutually exclusive"):
        parse_args(["--hf-checkpoint", missing, "--fp16", "--bf16"], core_groups())
    # the combination check of a *later* group still precedes an earlier group's path check
    with pytest.raises(ArgumentError, match="--update-weight-transfer-mode ipc requires"):
        parse_args(
            ["--hf-checkpoint", missing, "--update-weight-transfer-mode", "ipc"], core_groups()
        )
    with pytest.raises(ArgumentError, match="no such directory"):
        parse_args(["--hf-checkpoint", missing], core_groups())


def test_hooks_run_in_order_for_all_groups():
    calls = []

    @dataclass
    class First(ArgGroup):
        a: int = flag(1, help="a")

        @classmethod
        def validate(cls, args):
            calls.append(("validate", "First", args.b))

        @classmethod
        def resolve_defaults(cls, args):
            calls.append(("resolve", "First"))

        @classmethod
        def check_paths(cls, args):
            calls.append(("paths", "First"))

    @dataclass
    class Second(ArgGroup):
        b: int | None = flag(None, help="b")

        @classmethod
        def validate(cls, args):
            calls.append(("validate", "Second", args.b))

        @classmethod
        def resolve_defaults(cls, args):
            args.b = args.a * 10
            calls.append(("resolve", "Second"))

        @classmethod
        def check_paths(cls, args):
            calls.append(("paths", "Second"))

    args = parse_args(["--a", "3"], [First, Second])
    assert args.b == 30
    # Defaults first: every group's validate sees the resolved value of every other group.
    assert calls == [
        ("resolve", "First"),
        ("resolve", "Second"),
        ("validate", "First", 30),
        ("validate", "Second", 30),
        ("paths", "First"),
        ("paths", "Second"),
    ]


def test_no_flag_is_declared_twice_across_installed_groups(tmp_path):
    groups = installed_groups()
    assert set(core_groups()) <= set(groups)
    specs = collect_flags(groups)  # raises on a duplicate, naming both groups
    options = [o for s in specs.values() for o in s.option_strings()]
    assert len(options) == len(set(options))
    # The composed CLI parses with its defaults plus the flags some group requires.
    argv = []
    if "prompt_data" in specs:  # the launcher's groups are installed
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
        argv = ["--prompt-data", str(prompts)]
    parse_args(argv, groups)


def test_duplicate_across_two_groups_names_both():
    @dataclass
    class BackendA(ArgGroup):
        title: ClassVar[str] = "a"
        dp_size: int = flag(1, help="x")

    @dataclass
    class BackendB(ArgGroup):
        title: ClassVar[str] = "b"
        dp_size: int = flag(2, help="y")

    with pytest.raises(ArgumentError) as err:
        parse_args([], [BackendA, BackendB])
    message = str(err.value)
    assert message.startswith("flag --dp-size is declared twice")
    assert "BackendA" in message and "BackendB" in message


def test_duplicate_with_a_shared_flag_and_with_a_no_form():
    @dataclass
    class Shadow(ArgGroup):
        lr: float = flag(0.1, help="again")

    @dataclass
    class NoSaveOptim(ArgGroup):
        no_save_optim: str = flag("x", help="collides with the --no- form of --save-optim")

    with pytest.raises(ArgumentError, match=r"flag --lr is declared twice: by .*OptimizerArgs"):
        parse_args([], [OptimizerArgs, Shadow])
    with pytest.raises(ArgumentError, match=r"flag --no-save-optim is declared twice"):
        parse_args([], [CheckpointArgs, NoSaveOptim])


def test_same_group_twice_is_one_group():
    args = parse_args(["--lr", "0.5"], [OptimizerArgs, OptimizerArgs])
    assert args.lr == 0.5


def test_entry_point_targets():
    assert groups_of_entry_point("one", OptimizerArgs) == [OptimizerArgs]
    assert groups_of_entry_point("many", core_groups) == core_groups()
    with pytest.raises(TypeError, match="entry point 'bad' returned"):
        groups_of_entry_point("bad", lambda: [int])
    with pytest.raises(TypeError, match="neither an ArgGroup"):
        groups_of_entry_point("bad", 42)


def test_entry_point_groups_by_name():
    assert entry_point_groups("core") == core_groups()
    with pytest.raises(ArgumentError, match=r"no installed package declares argument groups 'tpu'"):
        entry_point_groups("core", "tpu")


def test_selected_backend_before_full_parse(tmp_path):
    assert selected_backend([]) == "megatron"
    assert selected_backend(["--lr", "1", "--train-backend", "fsdp"]) == "fsdp"
    assert selected_backend(["--train-backend=fsdp"]) == "fsdp"
    # the last one, as argparse takes it (a script's flags, then the user's)
    assert (
        selected_backend(["--train-backend", "fsdp", "--train-backend", "megatron"]) == "megatron"
    )
    assert selected_backend(["--train-backend=megatron", "--train-backend=fsdp"]) == "fsdp"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train_backend: fsdp\n")
    assert selected_backend(["--config", str(cfg)]) == "fsdp"
    # the command line wins over the file, as in the full parse
    assert selected_backend(["--config", str(cfg), "--train-backend", "megatron"]) == "megatron"


def test_make_group_builds_a_parsable_group():
    generated = make_group(
        "GeneratedArgs",
        "generated",
        [
            ("num_layers", int | None, flag(None, help="layers")),
            ("sequence_parallel", bool, flag(False, help="sp")),
        ],
        module="tests.generated",
    )
    args = parse_args(["--num-layers", "4", "--sequence-parallel"], [*core_groups(), generated])
    assert (args.num_layers, args.sequence_parallel) == (4, True)
    with pytest.raises(TypeError, match="not declared with flag"):
        make_group("Bad", "bad", [("x", int, 3)])


def test_docs_table_lists_every_shared_flag():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "args.md").read_text()
    missing = [
        s.option for s in collect_flags(core_groups()).values() if f"`{s.option}`" not in docs
    ]
    assert missing == []


def test_tensorboard_dir_is_a_core_flag():
    """The launcher's reporting and the backends read it: core groups alone parse it."""
    assert parse_args(["--tensorboard-dir", "tb"], core_groups()).tensorboard_dir == "tb"
    assert parse_args([], core_groups()).tensorboard_dir is None
