#!/usr/bin/env python3
"""Print the pip requirement of a package exactly as ``uv.lock`` resolves it for another Python.

    python3 scripts/locked_requirement.py megatron-core --python 3.12
    # megatron-core==0.19.2 --hash=sha256:... --hash=sha256:...

``uv.lock`` may hold several versions of one package, each for a range of interpreters (its
``resolution-markers``): megatron-core 0.16.x below Python 3.12 and 0.19.x from 3.12 on. CI
runs the Megatron tests a second time on the 3.12 line; this prints that line's version with
every file hash the lock records for it, for ``pip install --require-hashes -r FILE``, so CI
installs the locked release and nothing else. Errors (no such package, no version for that
Python) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tomllib
from pathlib import Path

from packaging.markers import Marker

REPO = Path(__file__).resolve().parent.parent


def marker_environment(python: str) -> dict[str, str]:
    """This machine's marker environment with the interpreter version replaced by ``python``."""
    full = python if python.count(".") >= 2 else f"{python}.0"
    return {
        "python_version": ".".join(full.split(".")[:2]),
        "python_full_version": full,
        "platform_machine": platform.machine(),
        "sys_platform": sys.platform,
    }


def locked_entry(lock: dict, name: str, python: str) -> dict:
    """The lock's entry of ``name`` that applies to ``python`` on this platform."""
    entries = [p for p in lock["package"] if p["name"] == name]
    if not entries:
        raise LookupError(f"uv.lock has no package {name!r}")
    env = marker_environment(python)
    for entry in entries:
        markers = entry.get("resolution-markers")
        if not markers or any(Marker(m).evaluate(env) for m in markers):
            return entry
    versions = ", ".join(e["version"] for e in entries)
    raise LookupError(f"uv.lock has {name} {versions}, none resolved for Python {python}")


def requirement(entry: dict) -> str:
    """``name==version`` with every wheel and sdist hash of the entry."""
    files = list(entry.get("wheels", []))
    if "sdist" in entry:
        files.append(entry["sdist"])
    hashes = sorted({f["hash"] for f in files if "hash" in f})
    if not hashes:
        raise LookupError(f"uv.lock records no file hash for {entry['name']} {entry['version']}")
    return " ".join([f"{entry['name']}=={entry['version']}", *(f"--hash={h}" for h in hashes)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("name", help="the package's name as uv.lock spells it")
    parser.add_argument("--python", required=True, help="the interpreter version, e.g. 3.12")
    parser.add_argument("--lock", type=Path, default=REPO / "uv.lock")
    args = parser.parse_args(argv)
    try:
        lock = tomllib.loads(args.lock.read_text())
        print(requirement(locked_entry(lock, args.name, args.python)))
    except (OSError, LookupError, tomllib.TOMLDecodeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
