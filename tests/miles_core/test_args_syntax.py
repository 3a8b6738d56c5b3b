"""Command-line syntax of miles_core.args: every flag kind, both list forms, --flag=value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import pytest
from miles_core.args import ArgGroup, ArgumentError, build_parser, flag, group_flags, parse_args


@dataclass
class KindsArgs(ArgGroup):
    title: ClassVar[str] = "every kind"

    count: int = flag(3, help="an int")
    ratio: float = flag(0.5, help="a float")
    name: str = flag("x", help="a str")
    maybe_path: str | None = flag(None, help="an optional str")
    maybe_count: int | None = flag(None, help="an optional int")
    enabled: bool = flag(False, help="a bool defaulting off")
    keep: bool = flag(True, help="a bool defaulting on")
    auto: bool | None = flag(None, help="a tri-state")
    mode: Literal["a", "b", "c"] = flag("a", help="a Literal choice")
    level: str = flag("low", choices=["low", "high"], help="choices by flag()")
    names: list[str] = flag(["q", "k"], help="a list of str")
    sizes: list[int] | None = flag(None, help="an optional list of int")
    weights: list[float] = flag([], help="a list of float (100% literal percent sign)")


def parse(*argv: str):
    return parse_args(list(argv), [KindsArgs])


def test_defaults():
    args = parse()
    assert (args.count, args.ratio, args.name, args.maybe_path, args.maybe_count) == (
        3,
        0.5,
        "x",
        None,
        None,
    )
    assert (args.enabled, args.keep, args.auto) == (False, True, None)
    assert (args.mode, args.level, args.names, args.sizes, args.weights) == (
        "a",
        "low",
        ["q", "k"],
        None,
        [],
    )
    assert args.explicit_flags == frozenset()
    assert args.config is None
    assert args.sglang_passthrough == {} and args.router_passthrough == {}


def test_list_defaults_are_not_shared():
    first, second = parse(), parse()
    first.names.append("v")
    assert second.names == ["q", "k"]
    assert KindsArgs().names is not KindsArgs().names


def test_scalars_in_both_forms():
    args = parse("--count", "7", "--ratio=1e-3", "--name", "y", "--maybe-count=-2")
    assert (args.count, args.ratio, args.name, args.maybe_count) == (7, 1e-3, "y", -2)
    assert type(args.count) is int and type(args.ratio) is float
    assert args.explicit_flags == {"count", "ratio", "name", "maybe_count"}


def test_bool_pair():
    assert parse("--enabled").enabled is True
    assert parse("--no-enabled").enabled is False
    assert parse("--no-keep").keep is False
    assert parse("--keep").keep is True
    # last one wins, like any flag
    assert parse("--enabled", "--no-enabled").enabled is False


@pytest.mark.parametrize(
    ("argv", "expected"), [([], None), (["--auto"], True), (["--no-auto"], False)]
)
def test_tristate(argv, expected):
    args = parse(*argv)
    assert args.auto is expected
    assert ("auto" in args.explicit_flags) == bool(argv)


@pytest.mark.parametrize(
    "argv",
    [
        ["--names", "a", "b", "c"],
        ["--names", "a,b,c"],
        ["--names=a,b,c"],
        ["--names", "a,b", "c"],
        ["--names", "a, b", "c"],
    ],
)
def test_list_forms(argv):
    assert parse(*argv).names == ["a", "b", "c"]


def test_typed_lists():
    args = parse("--sizes", "1,2", "3", "--weights", "0.5", "-1.5")
    assert args.sizes == [1, 2, 3]
    assert args.weights == [0.5, -1.5]


def test_list_ends_at_next_flag():
    args = parse("--names", "a", "b", "--count", "2")
    assert args.names == ["a", "b"] and args.count == 2


def test_choices():
    assert parse("--mode", "b").mode == "b"
    assert parse("--level=high").level == "high"
    with pytest.raises(ArgumentError, match=r"--mode: invalid choice: 'd'"):
        parse("--mode", "d")
    with pytest.raises(ArgumentError, match=r"--level: invalid choice"):
        parse("--level", "mid")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--count", "x"], r"argument --count: invalid int value: 'x'"),
        (["--ratio", "fast"], r"argument --ratio: invalid float value"),
        (["--count"], r"argument --count: expected one argument"),
        (["--sizes", "1,x"], r"argument --sizes: invalid int value: 'x'"),
        (["--names", "a,,b"], r"argument --names: empty list item"),
        (["--names"], r"argument --names: expected at least one argument"),
        (["--bogus", "1"], r"^unrecognized flag --bogus$"),
        (["--enabled=yes"], r"argument --enabled/--no-enabled: ignored explicit argument 'yes'"),
    ],
)
def test_bad_syntax_names_the_flag(argv, message):
    with pytest.raises(ArgumentError, match=message):
        parse(*argv)


def test_no_abbreviations():
    # argparse would otherwise take --coun for --count; a typo must not silently match.
    with pytest.raises(
        ArgumentError, match=r"^unrecognized flag --coun \(did you mean --count\?\)$"
    ):
        parse("--coun", "4")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cuont", "4"], "unrecognized flag --cuont (did you mean --count?)"),
        (["--ratoi=0.5"], "unrecognized flag --ratoi (did you mean --ratio?)"),
        (
            ["--cuont", "4", "--zzz"],
            "unrecognized flag --cuont (did you mean --count?) (and 1 more)",
        ),
        (["--enabeld"], "unrecognized flag --enabeld (did you mean --enabled?)"),  # not --no-
        (["--zzzzzz"], "unrecognized flag --zzzzzz"),  # nothing close: no guess
        (["4"], "unrecognized arguments: 4"),  # a stray value, not a flag
    ],
)
def test_an_unknown_flag_gets_the_closest_declared_ones(argv, message):
    with pytest.raises(ArgumentError) as error:
        parse(*argv)
    assert str(error.value) == message


def test_flag_names_and_help():
    specs = {s.dest: s for s in group_flags(KindsArgs)}
    assert specs["maybe_path"].option == "--maybe-path"
    assert specs["keep"].option_strings() == ["--keep", "--no-keep"]
    assert specs["auto"].tristate and not specs["keep"].tristate
    text = build_parser([KindsArgs], prog="prog").format_help()
    assert "100% literal" in text
    for option in ("--maybe-path", "--no-keep", "--auto", "--no-auto", "--config", "every kind"):
        assert option in text


def test_bad_declarations_are_refused():
    @dataclass
    class TriStateWithDefault(ArgGroup):
        x: bool | None = flag(True, help="h")

    @dataclass
    class PlainField(ArgGroup):
        x: int = 1

    @dataclass
    class Reserved(ArgGroup):
        config: str = flag("a", help="h")

    with pytest.raises(ValueError, match="help"):
        flag(1, help="")
    with pytest.raises(TypeError, match="must default to None"):
        group_flags(TriStateWithDefault)
    with pytest.raises(TypeError, match="not declared with flag"):
        group_flags(PlainField)
    with pytest.raises(ArgumentError, match="reserved"):
        parse_args([], [Reserved])
