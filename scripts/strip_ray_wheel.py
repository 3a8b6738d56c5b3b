#!/usr/bin/env python3
"""Make a copy of a Ray wheel without its Java jars, for GPU nodes that take wheels by hand.

Ray's Linux wheel is ~79 MB, and most of that is ``ray/jars/ray_dist.jar`` (Java workers only;
miles runs Python actors alone). A copy without ``ray/jars/`` is ~45 MB and installs and runs
Python jobs the same. This writes that copy: every member except ``ray/jars/*``, re-compressed,
and ``*.dist-info/RECORD`` rewritten without the removed files, so pip installs it like the
original (same name, same metadata).

    python3 scripts/strip_ray_wheel.py RAY_WHEEL OUT_DIR [--check]

``--check`` then installs the copy into a temporary folder and runs ``ray.init()`` and one remote
task from it, with this interpreter (so check a wheel built for the Python you run it with).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

STRIPPED_PREFIX = "ray/jars/"


def _is_stripped(name: str) -> bool:
    return name.startswith(STRIPPED_PREFIX)


def _rewrite_record(record: bytes, removed: set[str]) -> bytes:
    rows = list(csv.reader(io.StringIO(record.decode("utf-8"))))
    kept = [row for row in rows if row and row[0] not in removed]
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(kept)
    return out.getvalue().encode("utf-8")


def strip_wheel(wheel: Path, out_dir: Path) -> Path:
    """Write ``out_dir/<wheel name>`` without ``ray/jars/``; returns its path."""
    if not wheel.name.startswith("ray-") or not wheel.name.endswith(".whl"):
        raise SystemExit(f"strip_ray_wheel: {wheel} is not a Ray wheel (ray-*.whl)")
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / wheel.name
    if target.resolve() == wheel.resolve():
        raise SystemExit("strip_ray_wheel: OUT_DIR must differ from the wheel's folder")
    with zipfile.ZipFile(wheel) as src:
        infos = src.infolist()
        removed = {i.filename for i in infos if _is_stripped(i.filename)}
        # The wheel's own RECORD (vendored packages inside ray/ carry dist-info folders too).
        records = [i for i in infos if re.fullmatch(r"ray-[^/]+\.dist-info/RECORD", i.filename)]
        if len(records) != 1:
            raise SystemExit(f"strip_ray_wheel: {wheel} has {len(records)} RECORD files, not 1")
        with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
            for info in infos:
                if info.filename in removed:
                    continue
                data = src.read(info)
                if info is records[0]:
                    data = _rewrite_record(data, removed)
                # Keep names, dates and permissions; compression is ours.
                info.compress_type = zipfile.ZIP_DEFLATED
                dst.writestr(info, data, compresslevel=9)
    before, after = wheel.stat().st_size, target.stat().st_size
    print(
        f"strip_ray_wheel: {wheel.name}: removed {len(removed)} files under {STRIPPED_PREFIX}, "
        f"{before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB ({target})"
    )
    return target


CHECK_PROGRAM = """
import os, sys, ray
root = sys.argv[1]
assert ray.__file__.startswith(root), f"imported {ray.__file__}, not the stripped copy under {root}"
assert not os.path.exists(os.path.join(os.path.dirname(ray.__file__), "jars")), "jars present"
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
         object_store_memory=100 * 2**20)
@ray.remote
def square(x):
    return x * x
assert ray.get(square.remote(7)) == 49
ray.shutdown()
print(f"strip_ray_wheel: ray {ray.__version__} from the stripped wheel: ray.init() and a task ran")
"""


def _installer() -> list[str]:
    """pip of this interpreter, or uv's pip for it (uv-made virtual environments have no pip)."""
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip", "install"]
    if shutil.which("uv"):
        return ["uv", "pip", "install", "--python", sys.executable]
    raise SystemExit("strip_ray_wheel: --check needs pip or uv to install the wheel")


def check_wheel(stripped: Path) -> None:
    """Install the stripped wheel alone into a temporary folder and run a Ray task from it."""
    with tempfile.TemporaryDirectory(prefix="ray-stripped-") as root:
        subprocess.run(
            [*_installer(), "--quiet", "--no-deps", "--no-index", "--no-compile", "--target",
             root, str(stripped)],
            check=True,
        )  # fmt: skip
        # The stripped copy first on the path; its dependencies come from this interpreter.
        # (and no per-worker environment built by Ray under `uv run`)
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
            RAY_ENABLE_UV_RUN_RUNTIME_ENV="0",
        )
        subprocess.run([sys.executable, "-c", CHECK_PROGRAM, root], check=True, env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path, help="a ray-*.whl")
    parser.add_argument("out_dir", type=Path, help="where the stripped copy is written")
    parser.add_argument("--check", action="store_true", help="install it and run ray.init()")
    args = parser.parse_args(argv)
    if not args.wheel.is_file():
        parser.error(f"wheel: no such file {args.wheel}")
    stripped = strip_wheel(args.wheel, args.out_dir)
    if args.check:
        check_wheel(stripped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
