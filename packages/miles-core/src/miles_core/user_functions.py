"""Functions a user names on the command line (``MODULE:FUNCTION``), imported once.

Every flag that names one is declared with ``metavar=FUNCTION_METAVAR``: the preflight of a job
imports each of them (:func:`check_function_flags`) before anything starts, and each package's
code loads them with :func:`load_function`, so a typo is one line naming the flag, at once.
Every such flag accepts the same two forms (``MODULE:FUNCTION`` and ``MODULE.FUNCTION``): the
parser checks the form of each (:func:`check_function_specs`) with the one message of
:func:`function_spec`.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from miles_core.args.checks import flag_value
from miles_core.args.flags import FLAG_METADATA_KEY, ArgumentError

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


def load_function(spec: str, flag: str, *, coroutine: bool = False) -> Callable:
    """Import ``MODULE:FUNCTION`` (or ``MODULE.FUNCTION``); a bad spec, module or name is one
    :class:`ArgumentError` naming ``flag``. ``coroutine=True``: the function must be ``async``."""
    module_name, attr = function_spec(spec, flag)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ArgumentError(f"{flag} {spec}: cannot import {module_name} ({exc})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ArgumentError(f"{flag} {spec}: {module_name} has no function {attr}")
    if coroutine and not inspect.iscoroutinefunction(fn):
        raise ArgumentError(f"{flag} {spec}: {attr} must be an async function")
    return fn


def function_flags(groups: Iterable[type]) -> list[str]:
    """The dests of the flags of ``groups`` that name a user function."""
    dests = []
    for group in groups:
        for f in dataclasses.fields(group):
            meta = f.metadata.get(FLAG_METADATA_KEY)
            if meta is not None and meta.metavar == FUNCTION_METAVAR:
                dests.append(f.name)
    return dests


def check_function_specs(args: Any, groups: Iterable[type]) -> None:
    """The form of every user function the command line names (nothing is imported)."""
    for dest in function_flags(groups):
        spec = flag_value(args, dest)
        if spec:
            function_spec(spec, "--" + dest.replace("_", "-"))


def check_function_flags(args: Any, groups: Iterable[type]) -> None:
    """Import every user function the command line names (the first bad one raises)."""
    for dest in function_flags(groups):
        spec = flag_value(args, dest)
        if spec:
            load_function(spec, "--" + dest.replace("_", "-"))
