"""Functions a user names on the command line (``MODULE:FUNCTION``), imported once."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from miles_core.args import ArgumentError


def load_function(spec: str, flag: str) -> Callable:
    """Import ``MODULE:FUNCTION`` (or ``MODULE.FUNCTION``); a bad spec, module or name is one
    :class:`ArgumentError` naming ``flag``."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ArgumentError(f"{flag} {spec}: expected MODULE:FUNCTION")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ArgumentError(f"{flag} {spec}: cannot import {module_name} ({exc})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ArgumentError(f"{flag} {spec}: {module_name} has no function {attr}")
    return fn
