"""Composing groups into one argparse CLI, parsing, and the hooks run after parsing.

``parse_args(argv, groups)`` returns a flat namespace
(:class:`~miles_core.args.run_config.ParsedArgs`, an ``argparse.Namespace``) with one attribute per
declared flag plus:

* ``config``: the ``--config`` path or ``None``;
* ``sglang_passthrough`` / ``router_passthrough``: undeclared ``--sglang-*`` / ``--router-*`` flags;
* ``explicit_flags``: the dests set on the command line or in the YAML file (so a consumer can warn
  about an explicit value that another flag overrides);
* ``run_config``: the typed :class:`~miles_core.args.run_config.RunConfig` of the parsed groups,
  built after every hook has run.

Order: build (a flag declared twice is an error naming both groups) -> parse (CLI > YAML >
defaults) -> every group's ``resolve_defaults`` -> every group's ``validate`` -> the form of every
user function flag (:func:`~miles_core.args.function_flags.check_function_specs`) -> every group's
``check_paths`` -> ``run_config``. Defaults are resolved first, so that every check sees the values the job will
really use (the engine, the transfer mode, the offload settings), not an unset tri-state.
Every failure is an :class:`ArgumentError` with one line.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from miles_core.args.config_file import find_config_path, load_config
from miles_core.args.flags import ArgGroup, ArgumentError, FlagSpec, group_flags
from miles_core.args.function_flags import check_function_specs
from miles_core.args.help import HELP_ALL, HelpRequest, find_group, help_request, short_help
from miles_core.args.parsed import ParsedArgs
from miles_core.args.passthrough import PASSTHROUGH_PREFIXES, split_passthrough
from miles_core.args.run_config import RunConfig

#: Namespace attributes the framework sets itself; no group may declare them.
RESERVED_DESTS = frozenset(
    {"config", "help", "help_all", "explicit_flags", "run_config", *PASSTHROUGH_PREFIXES.values()}
)


class _RaisingParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise ArgumentError instead of printing and exiting, and
    whose unknown flags are answered with the closest declared ones."""

    def error(self, message: str) -> NoReturn:
        raise ArgumentError(message)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(unknown_flag_message(extras, list(self._option_string_actions)))
        return parsed


def unknown_flag_message(extras: Sequence[str], known: Sequence[str]) -> str:
    """``unrecognized flag --lrr (did you mean --lr?)`` for the first unknown ``--flag`` of
    ``extras`` (``--flag=value`` too); argparse's own wording for a stray value."""
    flags = [e.split("=", 1)[0] for e in extras if e.startswith("--")]
    if not flags:
        return f"unrecognized arguments: {' '.join(extras)}"
    unknown = flags[0]
    candidates = [k for k in known if k.startswith("--")]
    close: list[str] = []
    for match in difflib.get_close_matches(unknown, candidates, n=6, cutoff=0.8):
        base = match.replace("--no-", "--", 1)
        if all(c.replace("--no-", "--", 1) != base for c in close):  # --x or --no-x, not both
            close.append(match)
    close = close[:3]
    more = f" (and {len(flags) - 1} more)" if len(flags) > 1 else ""
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    return f"unrecognized flag {unknown}{hint}{more}"


class _ListAction(argparse.Action):
    """``--f a b`` and ``--f a,b`` (and mixes: ``--f a,b c``) all give ``[a, b, c]``."""

    def __init__(self, option_strings, dest, element_type=str, **kwargs):
        choices = kwargs.pop("choices", None)
        super().__init__(option_strings, dest, nargs="+", **kwargs)
        self.element_type = element_type
        self.element_choices = choices

    def __call__(self, parser, namespace, values, option_string=None):
        items = []
        for value in values:
            for part in value.split(","):
                part = part.strip()
                if not part:
                    raise argparse.ArgumentError(self, f"empty list item in {value!r}")
                try:
                    item = self.element_type(part)
                except ValueError:
                    name = self.element_type.__name__
                    raise argparse.ArgumentError(self, f"invalid {name} value: {part!r}") from None
                if self.element_choices is not None and item not in self.element_choices:
                    allowed = ", ".join(map(str, self.element_choices))
                    raise argparse.ArgumentError(
                        self, f"invalid choice: {item!r} (choose from {allowed})"
                    )
                items.append(item)
        setattr(namespace, self.dest, items)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` except for unset (``None``) defaults, whose help says what applies."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None:
            return action.help or ""
        return super()._get_help_string(action) or ""


def _unique_groups(groups: Sequence[type[ArgGroup]]) -> list[type[ArgGroup]]:
    seen: list[type[ArgGroup]] = []
    for group in groups:
        if group not in seen:
            seen.append(group)
    return seen


def _group_name(group: type[ArgGroup]) -> str:
    return f"{group.__module__}.{group.__qualname__}"


def collect_flags(groups: Sequence[type[ArgGroup]]) -> dict[str, FlagSpec]:
    """All flags of ``groups`` by dest; a flag declared twice raises naming both groups."""
    by_option: dict[str, FlagSpec] = {}
    by_dest: dict[str, FlagSpec] = {}
    for group in _unique_groups(groups):
        for spec in group_flags(group):
            if spec.dest in RESERVED_DESTS:
                raise ArgumentError(
                    f"flag {spec.option} of {_group_name(group)} is reserved by miles_core.args"
                )
            for option in spec.option_strings():
                other = by_option.get(option)
                if other is not None:
                    raise ArgumentError(
                        f"flag {option} is declared twice: by {_group_name(other.group)} "
                        f"and by {_group_name(group)}"
                    )
                by_option[option] = spec
            by_dest[spec.dest] = spec
    return by_dest


def _add_flag(container: Any, spec: FlagSpec, suppress: bool) -> None:
    # argparse %-formats help texts; a literal "%" in a help text must not break --help
    kwargs: dict[str, Any] = {"help": spec.meta.help.replace("%", "%%"), "dest": spec.dest}
    kwargs["default"] = argparse.SUPPRESS if suppress else spec.default
    if spec.meta.metavar is not None and spec.kind != "bool":
        kwargs["metavar"] = spec.meta.metavar
    if spec.kind == "bool":
        container.add_argument(spec.option, action=argparse.BooleanOptionalAction, **kwargs)
    elif spec.kind == "list":
        container.add_argument(
            spec.option,
            action=_ListAction,
            element_type=spec.base_type,
            choices=spec.choices,
            **kwargs,
        )
    else:
        container.add_argument(spec.option, type=spec.base_type, choices=spec.choices, **kwargs)


PASSTHROUGH_EPILOG = (
    "Undeclared --sglang-<flag> / --router-<flag> flags are passed to SGLang / the router."
)
CONFIG_HELP = "YAML file of flag values (kebab-case or snake_case keys); the command line wins"
USAGE = "%(prog)s [flags]"


def build_parser(
    groups: Sequence[type[ArgGroup]],
    *,
    prog: str | None = None,
    suppress_defaults: bool = False,
    epilog: str | None = None,
    options: bool = True,
    passthrough: bool = True,
) -> argparse.ArgumentParser:
    """One argparse parser with an argument group per ArgGroup (``title``), plus ``--config``
    and the help flags (``options=False``: the groups' flags only, for ``--help GROUP``).

    ``suppress_defaults=True`` leaves unset flags off the namespace (used to find explicit flags).
    ``epilog`` is printed after the flags, before the pass-through note (``passthrough=False``:
    a command that passes nothing through, without the note).
    """
    epilog = " ".join(e for e in (epilog, PASSTHROUGH_EPILOG if passthrough else None) if e)
    specs = collect_flags(groups)
    parser = _RaisingParser(
        prog=prog,
        usage=USAGE,
        allow_abbrev=False,
        add_help=False,
        formatter_class=_HelpFormatter,
        epilog=epilog or None,
    )
    if options:
        # parse_args answers the help flags before argparse sees them (miles_core.args.help)
        parser.add_argument(
            "-h",
            "--help",
            nargs="?",
            metavar="GROUP",
            default=argparse.SUPPRESS,
            help="the common flags of every group; with GROUP, every flag of that group",
        )
        parser.add_argument(
            HELP_ALL, action="store_true", default=argparse.SUPPRESS, help="every flag"
        )
        parser.add_argument(
            "--config",
            metavar="FILE.yaml",
            default=argparse.SUPPRESS if suppress_defaults else None,
            help=CONFIG_HELP,
        )
    sections: dict[type[ArgGroup], Any] = {}
    for spec in specs.values():
        if spec.group not in sections:
            title = spec.group.title or spec.group.__name__
            sections[spec.group] = parser.add_argument_group(title)
        _add_flag(sections[spec.group], spec, suppress_defaults)
    return parser


def help_text(
    request: HelpRequest,
    groups: Sequence[type[ArgGroup]],
    *,
    prog: str | None = None,
    epilog: str | None = None,
    passthrough: bool = True,
) -> str:
    """What ``--help`` / ``--help GROUP`` / ``--help-all`` print (:mod:`miles_core.args.help`);
    an unknown GROUP is an :class:`ArgumentError` naming the groups."""
    if request.form == "all":
        return build_parser(groups, prog=prog, epilog=epilog, passthrough=passthrough).format_help()
    if request.form == "group":
        group = find_group(groups, request.group or "")
        collect_flags(groups)  # the same "declared twice" error as a parse
        parser = build_parser([group], prog=prog, options=False, passthrough=False)
        parser.epilog = f"`{parser.prog} --help`: the common flags of every group."
        return parser.format_help()
    parser = build_parser(groups, prog=prog)
    config_note = f"--config FILE.yaml: {CONFIG_HELP}."
    passthrough_note = PASSTHROUGH_EPILOG if passthrough else None
    notes = [note for note in (epilog, config_note, passthrough_note) if note]
    return short_help(groups, parser.format_usage().strip(), notes, parser.prog)


def parse_args(
    argv: Sequence[str],
    groups: Sequence[type[ArgGroup]],
    *,
    prog: str | None = None,
    epilog: str | None = None,
    passthrough: bool = True,
) -> ParsedArgs:
    """Parse ``argv`` (without the program name) against ``groups`` and run every group's hooks.
    ``prog`` names the command in the usage line (``miles train``); ``epilog`` ends ``--help``.
    ``passthrough=False``: undeclared ``--sglang-*`` / ``--router-*`` flags are unknown flags
    (a command that starts no engine).
    A help flag (:mod:`miles_core.args.help`) prints its help and exits 0 before anything else.

    Raises :class:`ArgumentError` (one line) on any bad input.
    """
    argv = list(argv)
    groups = _unique_groups(groups)
    request = help_request(argv)
    if request is not None:
        text = help_text(request, groups, prog=prog, epilog=epilog, passthrough=passthrough)
        print(text, end="")
        sys.exit(0)
    specs = collect_flags(groups)
    parser = build_parser(groups, prog=prog, epilog=epilog, passthrough=passthrough)
    declared = {opt for spec in specs.values() for opt in spec.option_strings()}

    remaining, passed = split_passthrough(argv, declared) if passthrough else (argv, {})
    config_path = find_config_path(remaining)
    config_values: dict[str, Any] = {}
    if config_path is not None:
        config_values, config_passthrough = load_config(config_path, specs)
        for dest, values in config_passthrough.items():
            if values and not passthrough:
                raise ArgumentError(f"{config_path}: unknown key {next(iter(values))!r}")
            passed[dest] = {**values, **passed.get(dest, {})}
        parser.set_defaults(**config_values)

    args = parser.parse_args(remaining, namespace=ParsedArgs())
    explicit = vars(build_parser(groups, suppress_defaults=True).parse_args(remaining))
    args.explicit_flags = frozenset((set(explicit) | set(config_values)) - {"config"})
    for dest, values in passed.items():
        setattr(args, dest, values)

    for group in groups:
        group.resolve_defaults(args)
    for group in groups:
        group.validate(args)
    check_function_specs(args, groups)
    for group in groups:
        group.check_paths(args)
    args.run_config = RunConfig.from_namespace(args, groups)
    return args


def format_error(exc: ArgumentError) -> str:
    """The one line printed for an argument error: ``error: <message>``."""
    return "error: " + " ".join(str(exc).split())


def parse_args_or_exit(
    argv: Sequence[str],
    groups: Sequence[type[ArgGroup]],
    *,
    prog: str | None = None,
    epilog: str | None = None,
    passthrough: bool = True,
) -> ParsedArgs:
    """:func:`parse_args`, but a bad command line prints one ``error:`` line and exits with 2."""
    try:
        return parse_args(argv, groups, prog=prog, epilog=epilog, passthrough=passthrough)
    except ArgumentError as exc:
        print(format_error(exc), file=sys.stderr)
        sys.exit(2)
