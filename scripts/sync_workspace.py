#!/usr/bin/env python3
"""Install the workspace from ``uv.lock``, with a local CPU build of torch where one is at hand.

    python3 scripts/sync_workspace.py            # then: export UV_NO_SYNC=1; uv run pytest

``uv.lock`` holds torch as PyPI serves it: on Linux x86-64 that is the CUDA build, which pulls
several GB of ``nvidia-*`` and CUDA libraries. A machine without a GPU never uses them. When a CPU
wheel of the *locked* torch release for this Python is found (``torch-<version>+cpu-...whl``), this
script runs ``uv sync --frozen`` without torch and its CUDA-only dependencies, then installs that
wheel into the environment. Otherwise it runs a plain ``uv sync --frozen`` (the locked CUDA build
on Linux x86-64, the platform's build elsewhere), so the same command works on every machine.

Where it looks for the wheel, in order: ``$MILES_TORCH_WHEEL`` (a file), ``$MILES_TORCH_WHEEL_DIR``
(a directory), then pip's own ``find-links`` (``$PIP_FIND_LINKS`` and ``pip config``).

After a CPU-torch install, a plain ``uv run`` would re-sync the environment to the lock (and
download the CUDA build): run ``uv run --no-sync ...`` or set ``UV_NO_SYNC=1``, as ``.ci/run`` does.
The script prints which of the two installs it made. Extra arguments go to ``uv sync``.

Both installs compile every installed module to bytecode (``--compile-bytecode``), the workspace's
own sources too (``compileall``). Where ``PYTHONDONTWRITEBYTECODE`` is set (container images set it
often) Python writes no ``.pyc`` of its own, so without this every process compiled torch,
transformers and the rest from source each time it imported them: about 40% of a trainer rank's
start-up (docs/ci.md).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CUDA_PREFIXES = ("nvidia-", "cuda-")
#: the workspace packages' sources (installed editable, so ``uv sync`` does not compile them)
WORKSPACE_SOURCES = [
    *sorted(str(p) for p in (REPO / "packages").glob("*/src")),
    str(REPO / "native" / "src"),
]


def lock_packages(lock: Path) -> dict[str, dict]:
    """The lock's packages by name (one entry per name; the first version listed)."""
    packages: dict[str, dict] = {}
    for package in tomllib.loads(lock.read_text())["package"]:
        packages.setdefault(package["name"], package)
    return packages


def locked_torch_version(packages: dict[str, dict]) -> str:
    if "torch" not in packages:
        raise SystemExit("sync: uv.lock has no torch")
    return packages["torch"]["version"]


def cuda_only_packages(packages: dict[str, dict]) -> set[str]:
    """Packages the lock holds only because torch's CUDA build needs them.

    The ``nvidia-*`` and ``cuda-*`` dependencies of torch and everything they pull in, less
    anything some other package (not torch, not one of these) also depends on.
    """

    def deps(name: str) -> set[str]:
        package = packages.get(name, {})
        listed = list(package.get("dependencies", []))
        for extra in package.get("optional-dependencies", {}).values():
            listed.extend(extra)
        return {d["name"] for d in listed}

    closure: set[str] = set()
    todo = [d for d in deps("torch") if d.startswith(CUDA_PREFIXES)]
    while todo:
        name = todo.pop()
        if name not in closure:
            closure.add(name)
            todo.extend(deps(name))
    needed_elsewhere = set()
    for name in packages:
        if name == "torch" or name in closure:
            continue
        needed_elsewhere |= deps(name) & closure
    return closure - needed_elsewhere


def _pip_find_links() -> list[str]:
    """pip's ``find-links`` settings (environment and configuration files)."""
    found = os.environ.get("PIP_FIND_LINKS", "").split()
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.strip().endswith("find-links"):
            found.extend(shlex.split(value.strip().strip("'\"")))
    return found


def cpu_wheel_candidates() -> list[Path]:
    """Directories and files where a CPU torch wheel may lie, most specific first."""
    places: list[Path] = []
    if os.environ.get("MILES_TORCH_WHEEL"):
        places.append(Path(os.environ["MILES_TORCH_WHEEL"]))
    if os.environ.get("MILES_TORCH_WHEEL_DIR"):
        places.append(Path(os.environ["MILES_TORCH_WHEEL_DIR"]))
    for link in _pip_find_links():
        if link.startswith("file://"):
            link = link[len("file://") :]
        if "://" not in link:
            places.append(Path(link))
    return places


def find_cpu_torch_wheel(version: str, places: list[Path] | None = None) -> Path | None:
    """A ``torch-<version>+cpu`` wheel for this interpreter and platform, if one is at hand."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    machine = sysconfig.get_platform().split("-")[-1]  # x86_64, aarch64
    pattern = re.compile(
        rf"^torch-{re.escape(version)}\+cpu-{tag}-{tag}-(manylinux|linux)\w*_{machine}\.whl$"
    )
    for place in cpu_wheel_candidates() if places is None else places:
        files = [place] if place.is_file() else sorted(place.glob("torch-*.whl"))
        for wheel in files:
            if place.is_dir() and not pattern.match(wheel.name):
                continue
            if place.is_file() and not wheel.name.startswith(f"torch-{version}+cpu-"):
                raise SystemExit(
                    f"sync: MILES_TORCH_WHEEL={wheel} is not a CPU wheel of the locked torch {version}"
                )
            return wheel
    return None


def venv_python() -> Path:
    venv = Path(os.environ.get("UV_PROJECT_ENVIRONMENT", REPO / ".venv"))
    return venv / "bin" / "python"


def compile_workspace(python: Path) -> int:
    """The workspace's own sources to bytecode (``py_compile`` writes it whatever
    ``PYTHONDONTWRITEBYTECODE`` says)."""
    return subprocess.call([str(python), "-m", "compileall", "-q", *WORKSPACE_SOURCES], cwd=REPO)


def main(argv: list[str]) -> int:
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None:
        print("sync: uv is not installed (python3 -m pip install uv)", file=sys.stderr)
        return 2
    packages = lock_packages(REPO / "uv.lock")
    version = locked_torch_version(packages)
    wheel = find_cpu_torch_wheel(version) if sys.platform == "linux" else None
    if wheel is None:
        print(f"sync: uv sync --frozen (torch {version} from the package index)", flush=True)
        rc = subprocess.call([uv, "sync", "--frozen", "--compile-bytecode", *argv], cwd=REPO)
        return rc or compile_workspace(venv_python())
    skipped = ["torch", *sorted(cuda_only_packages(packages))]
    print(
        f"sync: uv sync --frozen without torch and {len(skipped) - 1} CUDA-only packages, "
        f"then torch from {wheel.name}",
        flush=True,
    )
    cmd = [uv, "sync", "--frozen", "--compile-bytecode", *argv]
    for name in skipped:
        cmd += ["--no-install-package", name]
    rc = subprocess.call(cmd, cwd=REPO)
    if rc:
        return rc
    python = venv_python()
    rc = subprocess.call(
        [uv, "pip", "install", "-q", "--no-deps", "--compile-bytecode", "--python", str(python)]
        + [str(wheel)],
        cwd=REPO,
    )
    rc = rc or compile_workspace(python)
    if rc == 0:
        print("sync: done; run tests with `uv run --no-sync ...` or UV_NO_SYNC=1", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
