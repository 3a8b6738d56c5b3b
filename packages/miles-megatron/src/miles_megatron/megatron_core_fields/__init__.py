"""megatron-core's config fields that become flags (:mod:`miles_megatron.generated_flags`), one
module per release ``uv.lock`` resolves (``v0_16_1`` holds 0.16.1's), so that parsing a command
line needs no import of megatron-core. A module is written by ``python -m
miles_megatron.generated_flags --write`` with its release installed;
tests/miles_megatron/test_generated_flags.py holds the installed release's rows against it.
Rows: (config class, field, type code, megatron-core's default as text).
"""

from __future__ import annotations

import importlib
import pkgutil


def release_module(release: str) -> str:
    """The module name that holds ``release``'s rows: ``0.16.1`` -> ``v0_16_1``."""
    return "v" + release.replace(".", "_")


def rows_of(release: str | None) -> tuple[tuple[str, str, str, str], ...] | None:
    """``release``'s rows, or None when no module holds them."""
    if release is None:
        return None
    names = {m.name for m in pkgutil.iter_modules(__path__)}
    if release_module(release) not in names:
        return None
    return importlib.import_module(f"{__name__}.{release_module(release)}").ROWS
