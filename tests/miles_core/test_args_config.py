"""--config YAML files (precedence, key spellings, conversion, unknown keys) and passthrough."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
from miles_core.args import (
    ArgGroup,
    ArgumentError,
    core_groups,
    flag,
    parse_args,
    passthrough_to_argv,
)


@dataclass
class SmallArgs(ArgGroup):
    title: ClassVar[str] = "small"

    lr_scale: float = flag(1.0, help="a float")
    steps: int = flag(10, help="an int")
    tag: str | None = flag(None, help="an optional str")
    fast: bool = flag(False, help="a bool")
    auto: bool | None = flag(None, help="a tri-state")
    modules: list[str] = flag(["a"], help="a list")
    ids: list[int] | None = flag(None, help="a list of int")


@dataclass
class RouterArgs(ArgGroup):
    """Stands in for the launcher's group, which declares --sglang-router-ip/-port."""

    title: ClassVar[str] = "router"

    sglang_router_ip: str | None = flag(None, help="external router address")


def write(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_yaml_sets_values_in_both_key_spellings(tmp_path):
    cfg = write(
        tmp_path,
        "lr-scale: 1e-6\nsteps: 4\ntag: run1\nfast: true\nauto: false\n"
        "modules: [q, k]\nids: '1,2,3'\n",
    )
    args = parse_args(["--config", cfg], [SmallArgs])
    # "1e-6" is a YAML string (YAML 1.1 floats need a dot); it still becomes the float flag value
    assert args.lr_scale == 1e-6 and type(args.lr_scale) is float
    assert (args.steps, args.tag, args.fast, args.auto) == (4, "run1", True, False)
    assert args.modules == ["q", "k"] and args.ids == [1, 2, 3]
    assert args.config == cfg
    assert args.explicit_flags == {"lr_scale", "steps", "tag", "fast", "auto", "modules", "ids"}

    snake = write(tmp_path, "lr_scale: 0.5\nsteps: 2\n")
    args = parse_args([f"--config={snake}"], [SmallArgs])
    assert (args.lr_scale, args.steps) == (0.5, 2)


def test_precedence_cli_over_yaml_over_defaults(tmp_path):
    cfg = write(tmp_path, "steps: 4\ntag: from-yaml\nfast: true\nmodules: x,y\n")
    args = parse_args(["--steps", "5", "--config", cfg, "--no-fast"], [SmallArgs])
    assert args.steps == 5  # CLI, even though --config comes later on the line
    assert args.tag == "from-yaml"  # YAML
    assert args.fast is False  # CLI
    assert args.modules == ["x", "y"]  # YAML
    assert args.lr_scale == 1.0  # default


def test_unknown_yaml_key_names_key_and_file(tmp_path):
    cfg = write(tmp_path, "steps: 4\nlearning-rate: 0.1\n")
    with pytest.raises(ArgumentError) as err:
        parse_args(["--config", cfg], [SmallArgs])
    assert (
        str(err.value) == f"--config {cfg}: unknown key 'learning-rate' (no flag --learning-rate)"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("steps: many\n", r"key 'steps': expected int, got 'many'"),
        ("steps: 2.5\n", r"key 'steps': expected int, got 2.5"),
        ("fast: 1\n", r"key 'fast': expected true or false, got 1"),
        ("steps: null\n", r"key 'steps': a value is required"),
        ("ids: [1, x]\n", r"key 'ids': expected int, got 'x'"),
        ("- steps\n", r"expected a mapping of flag names to values"),
        ("steps: [1\n", r"not valid YAML at line"),
        ("config: other.yaml\n", r"cannot name another config file"),
    ],
)
def test_bad_yaml_values(tmp_path, text, message):
    cfg = write(tmp_path, text)
    with pytest.raises(ArgumentError, match=message):
        parse_args(["--config", cfg], [SmallArgs])


def test_missing_config_file(tmp_path):
    with pytest.raises(ArgumentError, match=r"--config .*nope.yaml: cannot read"):
        parse_args(["--config", str(tmp_path / "nope.yaml")], [SmallArgs])
    with pytest.raises(ArgumentError, match=r"--config: given 2 times"):
        parse_args(["--config", "a.yaml", "--config", "b.yaml"], [SmallArgs])


def test_yaml_choices_are_checked(tmp_path):
    cfg = write(tmp_path, "lr-decay-style: exponential\n")
    with pytest.raises(ArgumentError, match=r"key 'lr-decay-style': invalid choice 'exponential'"):
        parse_args(["--config", cfg], core_groups())


def test_passthrough_forms():
    args = parse_args(
        [
            "--sglang-mem-fraction-static",
            "0.7",
            "--steps",
            "3",
            "--sglang-enable-dp-attention",
            "--sglang-log-level=INFO",
            "--router-balance-abs-threshold",
            "4",
            "--sglang-cuda-graph-bs-decode",
            "1",
            "2",
            "4",
            "--sglang-offset",
            "-1",
        ],
        [SmallArgs],
    )
    assert args.steps == 3
    assert args.sglang_passthrough == {
        "mem-fraction-static": "0.7",
        "enable-dp-attention": True,
        "log-level": "INFO",
        "cuda-graph-bs-decode": ["1", "2", "4"],
        "offset": "-1",
    }
    assert args.router_passthrough == {"balance-abs-threshold": "4"}
    assert passthrough_to_argv(args.sglang_passthrough) == [
        "--mem-fraction-static",
        "0.7",
        "--enable-dp-attention",
        "--log-level",
        "INFO",
        "--cuda-graph-bs-decode",
        "1",
        "2",
        "4",
        "--offset",
        "-1",
    ]


def test_declared_flag_wins_over_passthrough():
    args = parse_args(
        ["--sglang-router-ip", "10.0.0.1", "--sglang-router-port", "3000"], [SmallArgs, RouterArgs]
    )
    assert args.sglang_router_ip == "10.0.0.1"
    assert args.sglang_passthrough == {"router-port": "3000"}
    args = parse_args(["--sglang-router-ip=10.0.0.2"], [SmallArgs, RouterArgs])
    assert args.sglang_router_ip == "10.0.0.2" and args.sglang_passthrough == {}


def test_bare_prefix_is_not_passthrough():
    with pytest.raises(ArgumentError, match="unrecognized flag --sglang-"):
        parse_args(["--sglang-"], [SmallArgs])


def test_passthrough_in_yaml_and_cli_wins(tmp_path):
    cfg = write(
        tmp_path,
        "sglang-mem-fraction-static: 0.8\nsglang_log_level: DEBUG\nsglang-enable-memory-saver: true\n"
        "sglang-disable-radix-cache: false\nrouter-policy: cache_aware\n",
    )
    args = parse_args(["--config", cfg, "--sglang-mem-fraction-static", "0.6"], [SmallArgs])
    assert args.sglang_passthrough == {
        "mem-fraction-static": "0.6",
        "log-level": "DEBUG",
        "enable-memory-saver": True,
    }
    assert args.router_passthrough == {"policy": "cache_aware"}


def test_yaml_cannot_override_declared_by_passthrough_spelling(tmp_path):
    cfg = write(tmp_path, "sglang-router-ip: 10.0.0.9\n")
    args = parse_args(["--config", cfg], [SmallArgs, RouterArgs])
    assert args.sglang_router_ip == "10.0.0.9" and args.sglang_passthrough == {}


def test_yaml_no_form_of_a_boolean(tmp_path):
    cfg = write(tmp_path, "no-save-optim: true\nno_load_rng: false\n")
    args = parse_args(["--config", cfg], core_groups())
    assert args.save_optim is False and args.load_rng is True
    assert {"save_optim", "load_rng"} <= args.explicit_flags
    bad = write(tmp_path, "no-lr: true\n")
    with pytest.raises(ArgumentError, match="unknown key 'no-lr'"):
        parse_args(["--config", bad], core_groups())
