"""The flags that name a user function (metavar ``MODULE:FUNC``) and the form of their values,
checked by the parser before any hook imports one (:mod:`miles_core.user_functions` loads them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

from miles_core.args.checks import flag_value
from miles_core.args.flags import FLAG_METADATA_KEY, ArgumentError
from miles_core.args.parsed import ParsedArgs

#: The metavar of every flag whose value is a user function.
FUNCTION_METAVAR = "MODULE:FUNC"


def function_spec(spec: str, flag: str) -> tuple[str, str]:
    """``(module, function)`` of ``MODULE:FUNCTION`` or ``MODULE.FUNCTION``; any other form is
    one :class:`ArgumentError` naming ``flag`` (the same words for every flag)."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ArgumentError(f"{flag} {spec}: expected MODULE:FUNCTION or MODULE.FUNCTION")
    return module_name, attr


def function_flags(groups: Iterable[type]) -> list[str]:
    """The dests of the flags of ``groups`` that name a user function."""
    dests = []
    for group in groups:
        for f in dataclasses.fields(group):
            meta = f.metadata.get(FLAG_METADATA_KEY)
            if meta is not None and meta.metavar == FUNCTION_METAVAR:
                dests.append(f.name)
    return dests


def named_functions(args: ParsedArgs, groups: Iterable[type]) -> Iterator[tuple[str, str]]:
    """``(flag, spec)`` of every user function the command line names, in the order of the
    groups' flags (``("--custom-rm-path", "my_rm:reward")``); unset flags are skipped."""
    for dest in function_flags(groups):
        spec = flag_value(args, dest)
        if spec:
            yield "--" + dest.replace("_", "-"), spec


def check_function_specs(args: ParsedArgs, groups: Iterable[type]) -> None:
    """The form of every user function the command line names (nothing is imported)."""
    for flag, spec in named_functions(args, groups):
        function_spec(spec, flag)
