"""Flags generated from megatron-core's config dataclasses.

Every field of ``TransformerConfig``, ``OptimizerConfig`` and ``DistributedDataParallelConfig``
whose type is a plain scalar (int, float, str, bool, a Literal of strings, a list of int/str,
or their Optional forms) becomes a kebab-case flag (``moe_router_dtype`` ->
``--moe-router-dtype``), unless a flag of that name is already declared (miles-core's groups,
:mod:`miles_megatron.arch_args`, :mod:`miles_megatron.args`) or the backend sets the field
itself (:data:`BACKEND_OWNED_FIELDS`). Every generated flag defaults to unset: megatron-core's
own default applies, and only a value given on the command line is passed on
(:func:`config_overrides`).

Parsing a command line does not import megatron-core (an argument error is reported in a
second): the fields come from :mod:`miles_megatron.megatron_core_fields`, generated from each
release ``uv.lock`` resolves (one module per release) and held against the installed release by
a test. A release without a module is read from megatron-core itself. After changing the locked
release, write its module: ``python -m miles_megatron.generated_flags --write``.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import types
import typing
from collections.abc import Iterable
from typing import Any, Literal

from miles_core.args import (
    ArgGroup,
    ArgumentError,
    collect_flags,
    core_groups,
    flag,
    make_group,
)
from miles_core.args.checks import flag_value
from miles_core.args.help import kebab_case
from miles_core.args.parsed import ParsedArgs

from miles_megatron import megatron_core_fields as fields
from miles_megatron.megatron_core_fields import rows_of

#: Fields the backend derives from other flags; never flags of their own.
BACKEND_OWNED_FIELDS = frozenset(
    {
        "params_dtype",
        "pipeline_dtype",
        "autocast_dtype",
        "num_moe_experts",  # --num-experts
        "gated_linear_unit",  # --swiglu
        "activation_func",
        "layernorm_epsilon",  # --norm-epsilon
        "add_bias_linear",  # --disable-bias-linear
        "variable_seq_lengths",
        "timers",
    }
)

_SCALARS = (int, float, str, bool)


#: A row: (config class, field, type code, megatron-core's default as text). Type
#: codes: ``int``, ``float``, ``str``, ``bool``, ``list[int]``, ``list[str]``, ``literal:a|b``.
Row = tuple[str, str, str, str]


def _type_code(annotation: Any) -> str | None:
    """The type code of a config field's annotation, or None to skip the field."""
    inner = annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) != 1:
            return None
        inner = members[0]
    inner_origin = typing.get_origin(inner)
    if inner in _SCALARS:
        return inner.__name__
    if inner_origin is Literal:
        values = typing.get_args(inner)
        if values and all(isinstance(v, str) and "|" not in v for v in values):
            return "literal:" + "|".join(values)
        return None
    if inner_origin in (list, typing.List):  # noqa: UP006
        (element,) = typing.get_args(inner) or (None,)
        if element in (int, str):
            return f"list[{element.__name__}]"
    return None


def _flag_annotation(code: str) -> Any:
    """The ``X | None`` annotation of a type code's flag."""
    if code.startswith("literal:"):
        return typing.Optional[Literal[tuple(code.removeprefix("literal:").split("|"))]]  # noqa: UP045
    if code.startswith("list["):
        return list[{"int": int, "str": str}[code[5:-1]]] | None
    return {"int": int, "float": float, "str": str, "bool": bool}[code] | None


def _default_text(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return repr(field.default)
    return "computed"


def config_classes() -> list[type]:
    # megatron stays off the CLI's parse path (test_cli_help)
    from megatron.core.distributed import DistributedDataParallelConfig

    # megatron stays off the CLI's parse path (test_cli_help)
    from megatron.core.optimizer import OptimizerConfig

    # megatron stays off the CLI's parse path (test_cli_help)
    from megatron.core.transformer.transformer_config import TransformerConfig

    return [TransformerConfig, OptimizerConfig, DistributedDataParallelConfig]


def installed_release() -> str | None:
    """The megatron-core release Python would import (its metadata: no import of it)."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def introspected_rows() -> tuple[Row, ...]:
    """Every flag-able field of the installed megatron-core's config classes (imports it)."""
    rows = []
    for cls in config_classes():
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if field.name.startswith("_"):
                continue
            code = _type_code(hints[field.name])
            if code is not None:
                rows.append((cls.__name__, field.name, code, _default_text(field)))
    return tuple(rows)


def field_rows() -> tuple[Row, ...]:
    """The installed release's rows: from its checked-in module, else from megatron-core."""
    rows = rows_of(installed_release())
    return introspected_rows() if rows is None else rows


def generated_groups(declared: Iterable[type[ArgGroup]] = ()) -> list[type[ArgGroup]]:
    """One group per megatron-core config class, skipping names already declared; made once per
    process and ``declared`` (the same classes every time: a ``RunConfig`` holds instances)."""
    key = tuple(declared)
    if key not in _GENERATED:
        _GENERATED[key] = _make_generated_groups(key)
    return list(_GENERATED[key])


_GENERATED: dict[tuple[type[ArgGroup], ...], list[type[ArgGroup]]] = {}


def __getattr__(name: str) -> Any:
    """A generated group by its class name, made on first use: what pickle looks up when it
    rebuilds a ``RunConfig`` in a process that has not parsed a command line (a Ray actor)."""
    if name.startswith("Generated") and name.endswith("Args"):
        from miles_megatron.args import megatron_groups  # cycle: miles_megatron.args imports this

        for group in megatron_groups():
            if group.__name__ == name:
                return group
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _make_generated_groups(declared: tuple[type[ArgGroup], ...]) -> list[type[ArgGroup]]:
    taken = set(collect_flags([*core_groups(), *declared]))
    taken |= BACKEND_OWNED_FIELDS
    by_class: dict[str, list] = {}
    for config, name, code, default in field_rows():
        triples = by_class.setdefault(config, [])
        if name in taken:
            continue
        help_text = f"megatron-core {config}.{name} (default {default})."
        triples.append((name, _flag_annotation(code), flag(None, help=help_text)))
        taken.add(name)
    groups = [
        make_group(
            f"Generated{config}Args",
            f"megatron-core {config} fields",
            triples,
            module=__name__,
            help_name=kebab_case(config),
        )
        for config, triples in by_class.items()
    ]
    # importable by name, as pickle finds a class (a RunConfig holds instances of them)
    globals().update({group.__name__: group for group in groups})
    return groups


def generated_value(args: ParsedArgs, name: str) -> Any:
    """The value of the generated flag ``name``; None (megatron-core's default applies) when
    the installed megatron-core has no such field, so that no flag was generated for it."""
    return flag_value(args, name) if name in args else None


def write_release_module() -> str:
    """Write the installed release's rows into its module of
    :mod:`miles_megatron.megatron_core_fields` (the other releases' modules are left)."""
    release = installed_release()
    if release is None:
        raise SystemExit("megatron-core is not installed")
    lines = [
        f'"""megatron-core {release}\'s config fields that become flags (written by',
        "``python -m miles_megatron.generated_flags --write``; see the package docstring).",
        '"""',
        "",
        "ROWS = (",
    ]
    lines += [f"    {row!r}," for row in introspected_rows()]
    lines.append(")")
    target = os.path.join(os.path.dirname(fields.__file__), fields.release_module(release) + ".py")
    with open(target, "w") as out:
        out.write("\n".join(lines) + "\n")
    return target


def config_overrides(args: ParsedArgs, config_cls: type) -> dict[str, Any]:
    """Values of ``config_cls``'s generated flags that were set (not None)."""
    group_name = f"Generated{config_cls.__name__}Args"
    from miles_megatron.args import megatron_groups  # cycle: miles_megatron.args imports this

    (group,) = [g for g in megatron_groups() if g.__name__ == group_name]
    out = {}
    for field in dataclasses.fields(group):
        value = flag_value(args, field.name)
        if value is not None:
            out[field.name] = value
    return out


#: The generated fields the backend honours, with the values it accepts (None: any). Any other
#: generated flag given on the command line is refused at argument time: megatron-core would
#: accept it and the backend would crash at init or silently not do it (``--optimizer sgd``,
#: ``--virtual-pipeline-model-parallel-size``, ``--use-megatron-fsdp``, ...).
HONOURED_FIELDS: dict[str, tuple[Any, ...] | None] = {
    # TransformerConfig
    "recompute_granularity": None,
    "recompute_method": None,
    "recompute_num_layers": None,
    "recompute_modules": None,
    "moe_router_dtype": None,
    "moe_aux_loss_coeff": None,
    "moe_z_loss_coeff": None,
    "attention_dropout": None,
    "hidden_dropout": None,
    # OptimizerConfig (the LR schedule honours a group's own max/min LR: decoupled_*)
    "optimizer": ("adam",),
    "use_precision_aware_optimizer": None,
    "optimizer_offload_fraction": None,
    "overlap_cpu_optimizer_d2h_h2d": None,
    "decoupled_lr": None,
    "decoupled_min_lr": None,
    # DistributedDataParallelConfig
    "grad_reduce_in_fp32": None,
    "overlap_grad_reduce": None,
    "check_for_nan_in_grad": None,
    "bucket_size": None,
}


def check_generated_flags(args: ParsedArgs) -> None:
    """Refuse a generated flag given on the command line that is not in
    :data:`HONOURED_FIELDS`, or one given a value the backend does not take, in one line."""
    from miles_megatron.args import megatron_groups  # cycle: miles_megatron.args imports this

    for group in megatron_groups():
        if not group.__name__.startswith("Generated"):
            continue
        config = group.__name__.removeprefix("Generated").removesuffix("Args")
        for field in dataclasses.fields(group):
            value = flag_value(args, field.name)
            if value is None:
                continue
            option = "--" + field.name.replace("_", "-")
            if field.name not in HONOURED_FIELDS:
                raise ArgumentError(
                    f"{option}: megatron-core's {config}.{field.name} is not among the fields the "
                    "Megatron backend honours (miles_megatron.generated_flags.HONOURED_FIELDS)"
                )
            allowed = HONOURED_FIELDS[field.name]
            if allowed is not None and value not in allowed:
                raise ArgumentError(
                    f"{option} {value}: the Megatron backend takes {' or '.join(allowed)}"
                )


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python -m miles_megatron.generated_flags --write")
    print(f"wrote megatron-core {installed_release()}'s fields into {write_release_module()}")
