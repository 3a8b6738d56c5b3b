"""The installed environment holds bytecode for what every process imports.

Where ``PYTHONDONTWRITEBYTECODE`` is set, Python writes no ``.pyc`` of its own: each process
(a trainer rank, an engine, the driver, a test worker) then compiled torch, transformers and the
rest from source each time it imported them, about 40% of a trainer rank's start-up.
``scripts/sync_workspace.py`` compiles them at install (docs/ci.md). Where Python may write
bytecode the first import wrote it, and this passes the same.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

import torch
import transformers

SITE = {Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib")}


def _without_bytecode(modules) -> tuple[list[str], int]:
    """(the modules loaded from a ``.py`` file with no ``.pyc`` beside it, how many were checked)."""
    missing, checked = [], 0
    for name, module in list(modules):
        spec = getattr(module, "__spec__", None)
        origin = getattr(spec, "origin", None) or ""
        if not origin.endswith(".py") or not getattr(spec, "cached", None):
            continue
        checked += 1
        if not os.path.exists(spec.cached):
            missing.append(name)
    return missing, checked


def test_imported_site_packages_have_bytecode():
    assert torch.__spec__.cached and transformers.__spec__.cached
    site = [
        (name, module)
        for name, module in sys.modules.items()
        if any(
            Path(getattr(module, "__file__", None) or "/").resolve().is_relative_to(root)
            for root in SITE
        )
    ]
    missing, checked = _without_bytecode(site)
    # coverage: torch's and transformers' own modules are among those checked
    assert checked > 500, checked
    assert not missing, (
        f"{len(missing)} of {checked} imported modules have no bytecode (first: "
        f"{sorted(missing)[:5]}): install with scripts/sync_workspace.py, which compiles it"
    )
