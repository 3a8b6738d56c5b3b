"""Packaging: the wheels build, and each backend installs alone without the other's dependencies.

Builds a wheel of every workspace package (native included) with ``uv build``, then installs a
backend into a fresh virtual environment from exactly the wheels its metadata asks for, the
third-party dependencies coming from the package index (through uv's cache, so a warm run takes
seconds) and torch from the local ``/opt/wheels`` build the workspace uses.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from importlib.metadata import version
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
UV = os.environ.get("UV") or shutil.which("uv")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _clean_env() -> dict[str, str]:
    """The environment minus the outer virtual environment, so nothing leaks into the new one."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.pop("UV_PROJECT_ENVIRONMENT", None)
    return env


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=_clean_env(), **kwargs
    )
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}"
    return out


def _requires(wheel: Path) -> list[str]:
    """Unconditional Requires-Dist names of a wheel (extras' requirements are skipped)."""
    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(meta_name).decode())
    names = []
    for req in meta.get_all("Requires-Dist") or []:
        if "extra ==" in req:
            continue
        names.append(_normalize(re.match(r"[A-Za-z0-9._-]+", req).group(0)))
    return names


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    if UV is None:
        pytest.skip("uv is not installed")
    out_dir = tmp_path_factory.mktemp("wheels")
    _run([UV, "build", "--all-packages", "--wheel", "-o", str(out_dir)], cwd=REPO)
    built = {}
    for wheel in out_dir.glob("*.whl"):
        built[_normalize(wheel.name.split("-")[0])] = wheel
    expected = {
        "miles-core",
        "miles-native",
        "miles-offload",
        "miles-sync",
        "miles-fsdp",
        "miles-megatron",
        "miles-launch",
    }
    assert set(built) == expected
    return built


def _miles_closure(wheels: dict[str, Path], root: str) -> set[str]:
    """``root`` and every miles package its wheels require, transitively."""
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(dep for dep in _requires(wheels[name]) if dep.startswith("miles-"))
    return seen


def _install_alone(wheels: dict[str, Path], root: str, venv: Path) -> set[str]:
    """Fresh venv with ``root`` and its miles dependencies from the built wheels."""
    closure = _miles_closure(wheels, root)
    _run([UV, "venv", "-q", "--python", sys.executable, str(venv)])
    constraints = venv / "constraints.txt"
    # The torch this workspace runs on (on this machine kind, the CPU build in /opt/wheels).
    constraints.write_text(f"torch=={version('torch')}\n")
    python = venv / "bin" / "python"
    find_links = ["--find-links", "/opt/wheels"] if Path("/opt/wheels").is_dir() else []
    cmd = [UV, "pip", "install", "-q", "--python", str(python), "-c", str(constraints)]
    _run(cmd + find_links + [str(wheels[name]) for name in sorted(closure)])
    listed = _run([UV, "pip", "list", "--python", str(python), "--format", "freeze"]).stdout
    return {_normalize(line.split("==")[0]) for line in listed.splitlines() if "==" in line}


IMPORT_CHECK = (
    "import importlib.util, sys; import {module}; import miles_native; "
    "print(miles_native.build_info()); "
    "sys.exit(0 if importlib.util.find_spec({absent!r}) is None else 3)"
)


def test_miles_fsdp_installs_without_megatron(wheels, tmp_path):
    installed = _install_alone(wheels, "miles-fsdp", tmp_path / "venv")
    miles = {name for name in installed if name.startswith("miles-")}
    assert miles == {"miles-fsdp", "miles-sync", "miles-offload", "miles-core", "miles-native"}
    assert "megatron-core" not in installed
    assert {"torch", "transformers", "peft"} <= installed
    python = tmp_path / "venv" / "bin" / "python"
    out = _run([str(python), "-c", IMPORT_CHECK.format(module="miles_fsdp", absent="megatron")])
    assert "miles_native" in out.stdout


def test_miles_megatron_installs_without_peft(wheels, tmp_path):
    installed = _install_alone(wheels, "miles-megatron", tmp_path / "venv")
    miles = {name for name in installed if name.startswith("miles-")}
    assert miles == {"miles-megatron", "miles-sync", "miles-offload", "miles-core", "miles-native"}
    assert "peft" not in installed
    assert {"torch", "megatron-core"} <= installed
    python = tmp_path / "venv" / "bin" / "python"
    _run([str(python), "-c", IMPORT_CHECK.format(module="miles_megatron", absent="peft")])


def test_miles_launch_pulls_no_backend(wheels):
    required = _miles_closure(wheels, "miles-launch")
    assert required == {"miles-launch", "miles-sync", "miles-core"}
