"""No ``getattr(args, ...)`` read (a flag read with a default restated at the call site, or by a
computed name past the typed groups) comes back into the packages that read flags as ``args.x``,
``flag_value(args, dest)`` or ``args.run_config`` (docs/args.md "Reading flags")."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Every workspace package: each reads flags as attributes of the namespace or through
#: args.run_config.
TYPED_PACKAGES = tuple(sorted(p.name for p in (ROOT / "packages").iterdir() if p.is_dir()))


def test_no_getattr_args_reads_in_the_typed_packages():
    pattern = re.compile(r"getattr\(args\b")
    found: dict[str, int] = {}
    scanned = 0
    for package in TYPED_PACKAGES:
        for path in sorted((ROOT / "packages" / package).rglob("*.py")):
            scanned += 1
            count = len(pattern.findall(path.read_text()))
            if count:
                found[str(path.relative_to(ROOT))] = count
    assert {"miles-core", "miles-fsdp", "miles-megatron"} <= set(TYPED_PACKAGES)
    assert scanned > 100  # the packages' sources were read
    assert found == {}  # read args.x, flag_value(args, dest) or args.run_config (docs/args.md)
