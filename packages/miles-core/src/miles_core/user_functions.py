"""Functions a user names on the command line (``MODULE:FUNCTION``), imported once.

Every flag that names one is declared with ``metavar=FUNCTION_METAVAR``: the preflight of a job
imports each of them (:func:`check_function_flags`) before anything starts, and each package's
code loads them with :func:`load_function`, so a typo is one line naming the flag, at once.
Every such flag accepts the same two forms (``MODULE:FUNCTION`` and ``MODULE.FUNCTION``): the
parser checks the form of each (:func:`~miles_core.args.function_flags.check_function_specs`)
with the one message of :func:`~miles_core.args.function_flags.function_spec`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable

from miles_core.args.flags import ArgumentError
from miles_core.args.function_flags import (
    FUNCTION_METAVAR,
    check_function_specs,
    function_flags,
    function_spec,
    named_functions,
)
from miles_core.args.parsed import ParsedArgs

__all__ = [
    "FUNCTION_METAVAR",
    "check_function_flags",
    "check_function_specs",
    "function_flags",
    "function_spec",
    "load_function",
    "named_functions",
]


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


def check_function_flags(args: ParsedArgs, groups: Iterable[type]) -> None:
    """Import every user function the command line names (the first bad one raises)."""
    for flag, spec in named_functions(args, groups):
        load_function(spec, flag)
