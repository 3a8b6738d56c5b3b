"""Declaring flags: ``flag()`` fields on ``@dataclass`` subclasses of :class:`ArgGroup`.

A group is a dataclass whose fields are flags. The field's annotation gives the type and the
field name gives the flag: ``offload_train_disk_dir`` is ``--offload-train-disk-dir``.

Supported annotations (see :func:`flag_kind`):

* ``int``, ``float``, ``str`` and their ``X | None`` forms (``None`` = unset).
* ``bool``: ``--x`` / ``--no-x``.
* ``bool | None``: tri-state; the default ``None`` means "decided by another flag" and the
  owning group's ``resolve_defaults`` fills it in before validation.
* ``list[str]``, ``list[int]``, ``list[float]`` (and ``| None``): ``--f a b`` and ``--f a,b``.
* ``Literal["a", "b"]`` (and ``| None``): the choices; ``flag(choices=...)`` works too.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from miles_core.args.parsed import ParsedArgs

#: Key of the flag metadata inside ``dataclasses.field(metadata=...)``.
FLAG_METADATA_KEY = "miles_flag"


class ArgumentError(Exception):
    """A bad command line: a one-line message that names the flag(s), file or key at fault."""


@dataclass(frozen=True)
class FlagMeta:
    """What ``flag()`` records next to the dataclass field."""

    help: str
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    tristate: bool = False
    common: bool = False


def flag(
    default: Any,
    *,
    help: str,
    choices: typing.Sequence[Any] | None = None,
    metavar: str | None = None,
    tristate: bool = False,
    common: bool = False,
) -> Any:
    """A dataclass field that is a command-line flag.

    ``default`` is the value when neither the command line nor ``--config`` sets it. A list
    default is copied per instance. ``tristate=True`` is implied by a ``bool | None`` annotation
    and requires ``default=None``. ``common=True`` puts the flag on the short ``--help`` screen
    (the handful of its group a new user writes; ``--help-all`` lists every flag).
    """
    if not help:
        raise ValueError("flag() needs a help text")
    meta = {
        FLAG_METADATA_KEY: FlagMeta(
            help=help,
            choices=tuple(choices) if choices is not None else None,
            metavar=metavar,
            tristate=tristate,
            common=common,
        )
    }
    if isinstance(default, list):
        frozen = list(default)
        return dataclasses.field(default_factory=lambda: list(frozen), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


class ArgGroup:
    """Base of an argument group: subclass it as a ``@dataclass`` whose fields are ``flag()``.

    Hooks, all classmethods taking the full parsed namespace (every group's flags), run by
    :func:`miles_core.args.parse_args` in this order, each for all groups before the next:

    1. ``resolve_defaults(args)``: fill values derived from other flags (tri-states). It runs on
       unchecked values, so it must not fail on out-of-range numbers (``validate`` reports them).
    2. ``validate(args)``: flag-combination checks on the resolved values; reads no file. A check
       that must tell "explicit" from "derived" reads ``args.explicit_flags``.
    3. ``check_paths(args)``: filesystem checks ("file missing"), after every combination check.

    Each raises :class:`ArgumentError` with one line naming the flags.

    One more hook is not run by ``parse_args``: ``preflight(args)``, whether this machine and the
    files the job reads can run what the flags ask (a CUDA device, a checkpoint in a format the
    backend reads). A job's driver (``miles train``) calls it before it starts anything; a
    process that only parses the flags (a rank under ``torchrun``, a test, ``--help``) does not.
    """

    title: ClassVar[str] = ""
    #: The group's name for ``--help GROUP`` (unset: the class name, kebab-case, less ``Args``).
    help_name: ClassVar[str] = ""

    @classmethod
    def validate(cls, args: ParsedArgs) -> None:
        """Check flag combinations; raise ArgumentError. Must not touch the filesystem."""

    @classmethod
    def resolve_defaults(cls, args: ParsedArgs) -> None:
        """Set derived values (tri-state flags left at None) on ``args`` in place."""

    @classmethod
    def check_paths(cls, args: ParsedArgs) -> None:
        """Check that files and directories named by flags exist; raise ArgumentError."""

    @classmethod
    def preflight(cls, args: ParsedArgs) -> None:
        """Check that this machine and the files the flags name can run the job; raise
        ArgumentError naming the flag and the way out. Run by a job's driver only (see the
        class docstring), after every ``check_paths``."""


@dataclass(frozen=True)
class FlagSpec:
    """One flag, resolved from a group's dataclass field."""

    group: type[ArgGroup]
    dest: str  # attribute name on the namespace, e.g. "offload_train"
    kind: Literal["bool", "scalar", "list"]
    base_type: type  # int, float, str or bool (element type for lists)
    optional: bool  # the annotation admits None
    default: Any
    meta: FlagMeta
    choices: tuple[Any, ...] | None

    @property
    def option(self) -> str:
        """The flag as typed: ``--`` + dest with ``_`` -> ``-``."""
        return "--" + self.dest.replace("_", "-")

    @property
    def tristate(self) -> bool:
        return self.kind == "bool" and self.optional

    def option_strings(self) -> list[str]:
        """Every string that names this flag on the command line (``--no-x`` for booleans)."""
        if self.kind == "bool":
            return [self.option, "--no-" + self.option[2:]]
        return [self.option]


def _strip_optional(annotation: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(members) < len(typing.get_args(annotation))
        if len(members) != 1:
            raise TypeError(f"unsupported flag annotation {annotation!r}")
        return members[0], optional
    return annotation, False


def flag_kind(annotation: Any) -> tuple[str, type, bool, tuple[Any, ...] | None]:
    """``(kind, base_type, optional, literal_choices)`` of a field annotation."""
    inner, optional = _strip_optional(annotation)
    origin = typing.get_origin(inner)
    if origin is Literal:
        values = typing.get_args(inner)
        kinds = {type(v) for v in values}
        if len(kinds) != 1 or next(iter(kinds)) not in (int, float, str):
            raise TypeError(f"Literal flag values must share one of int/float/str: {inner!r}")
        return "scalar", next(iter(kinds)), optional, tuple(values)
    if origin is list:
        (element,) = typing.get_args(inner)
        if element not in (int, float, str):
            raise TypeError(f"list flags hold int, float or str, not {element!r}")
        return "list", element, optional, None
    if inner is bool:
        return "bool", bool, optional, None
    if inner in (int, float, str):
        return "scalar", inner, optional, None
    raise TypeError(f"unsupported flag annotation {annotation!r}")


def group_flags(group: type[ArgGroup]) -> list[FlagSpec]:
    """The flags of one group, in declaration order. Fields without ``flag()`` are an error."""
    if not (isinstance(group, type) and issubclass(group, ArgGroup)):
        raise TypeError(f"{group!r} is not an ArgGroup subclass")
    if not dataclasses.is_dataclass(group):
        raise TypeError(f"argument group {group.__qualname__} must be a @dataclass")
    hints = typing.get_type_hints(group)
    specs = []
    for field in dataclasses.fields(group):
        meta = field.metadata.get(FLAG_METADATA_KEY)
        if meta is None:
            raise TypeError(f"{group.__qualname__}.{field.name} is not declared with flag()")
        kind, base, optional, literal = flag_kind(hints[field.name])
        if field.default is not dataclasses.MISSING:
            default = field.default
        else:
            default = field.default_factory()
        if kind == "bool" and optional and default is not None:
            raise TypeError(
                f"tri-state flag {group.__qualname__}.{field.name} must default to None"
            )
        if meta.tristate and not (kind == "bool" and optional):
            raise TypeError(f"tristate=True needs a 'bool | None' annotation ({field.name})")
        if meta.choices is not None and literal is not None and set(meta.choices) != set(literal):
            raise TypeError(f"{field.name}: choices disagree with the Literal annotation")
        specs.append(
            FlagSpec(
                group=group,
                dest=field.name,
                kind=kind,
                base_type=base,
                optional=optional,
                default=default,
                meta=meta,
                choices=meta.choices if meta.choices is not None else literal,
            )
        )
    return specs


def make_group(
    name: str,
    title: str,
    fields: typing.Sequence[tuple[str, Any, Any]],
    *,
    module: str | None = None,
    help_name: str = "",
) -> type[ArgGroup]:
    """Build an :class:`ArgGroup` from ``(field_name, annotation, flag(...))`` triples.

    For groups generated from another library's config dataclasses (the Megatron backend's), where
    writing the class by hand would duplicate that library's list of fields.
    """
    group = dataclasses.make_dataclass(
        name,
        [tuple(f) for f in fields],
        bases=(ArgGroup,),
        namespace={"title": title, "help_name": help_name},
        frozen=True,
    )
    if module is not None:
        group.__module__ = module
    group_flags(group)  # fail now, not at parse time, on a bad field
    return group
