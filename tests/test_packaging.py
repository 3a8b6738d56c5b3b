"""Packaging: the wheels build, and each backend installs alone without the other's dependencies.

Builds a wheel of every workspace package (native included) with ``uv build``, then installs
``miles-launch[fsdp]`` and ``miles-launch[megatron]`` each into a fresh virtual environment from
exactly the wheels their metadata asks for, the third-party dependencies coming from the package
index (through uv's cache, so a warm run takes seconds), and runs ``miles train --help`` there.
torch is the workspace's locked release: a CPU wheel of it where one is at hand (found the way
``scripts/sync_workspace.py`` finds it), else the package index's build.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
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


def _run(
    cmd: list[str], extra_env: dict[str, str] | None = None, **kwargs
) -> subprocess.CompletedProcess:
    env = {**_clean_env(), **(extra_env or {})}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, **kwargs)
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
    # The native wheel as a machine without a CUDA toolkit builds it (AUTO would pick CUDA here
    # if an nvcc is on the PATH; GPU nodes build it with CUDA, BUILD_NOTES.md).
    _run(
        [UV, "build", "--all-packages", "--wheel", "-o", str(out_dir)],
        cwd=REPO,
        extra_env={"MILES_NATIVE_CUDA": "OFF"},
    )
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


def _sync_workspace():
    spec = importlib.util.spec_from_file_location(
        "sync_workspace", REPO / "scripts" / "sync_workspace.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _install_alone(wheels: dict[str, Path], root: str, extra: str, venv: Path) -> set[str]:
    """Fresh venv with ``root[extra]`` and its miles dependencies from the built wheels."""
    closure = _miles_closure(wheels, root) | _miles_closure(wheels, f"miles-{extra}")
    _run([UV, "venv", "-q", "--python", sys.executable, str(venv)])
    sync = _sync_workspace()
    torch_version = sync.locked_torch_version(sync.lock_packages(REPO / "uv.lock"))
    cpu_wheel = sync.find_cpu_torch_wheel(torch_version)
    torch_req = [str(cpu_wheel)] if cpu_wheel else [f"torch=={torch_version}"]
    python = venv / "bin" / "python"
    reqs = [
        f"{name}[{extra}] @ {wheels[name].as_uri()}" if name == root else str(wheels[name])
        for name in sorted(closure)
    ]
    _run([UV, "pip", "install", "-q", "--python", str(python), *torch_req, *reqs])
    listed = _run([UV, "pip", "list", "--python", str(python), "--format", "freeze"]).stdout
    return {_normalize(line.split("==")[0]) for line in listed.splitlines() if "==" in line}


def _miles_help(venv: Path) -> str:
    """``miles train --help-all`` from the venv, after checking the native extension imports there."""
    native = _run([str(venv / "bin" / "python"), "-c", NATIVE_CHECK]).stdout
    assert native.startswith("miles_native (") and "CUDA" not in native, native
    return _run([str(venv / "bin" / "miles"), "train", "--help-all"]).stdout


NATIVE_CHECK = "import miles_native; print(miles_native.build_info())"


def test_miles_launch_fsdp_installs_without_megatron(wheels, tmp_path):
    venv = tmp_path / "venv"
    installed = _install_alone(wheels, "miles-launch", "fsdp", venv)
    miles = {name for name in installed if name.startswith("miles-")}
    assert miles == {
        "miles-launch",
        "miles-fsdp",
        "miles-sync",
        "miles-offload",
        "miles-core",
        "miles-native",
    }
    assert "megatron-core" not in installed
    assert {"torch", "transformers", "peft", "ray"} <= installed
    help_text = _miles_help(venv)
    assert "--fsdp-cpu-offload" in help_text
    assert not re.search(r"^Megatron backend:", help_text, re.MULTILINE)


def test_miles_launch_megatron_installs_without_peft(wheels, tmp_path):
    venv = tmp_path / "venv"
    installed = _install_alone(wheels, "miles-launch", "megatron", venv)
    miles = {name for name in installed if name.startswith("miles-")}
    assert miles == {
        "miles-launch",
        "miles-megatron",
        "miles-sync",
        "miles-offload",
        "miles-core",
        "miles-native",
    }
    assert "peft" not in installed
    assert {"torch", "megatron-core", "ray"} <= installed
    help_text = _miles_help(venv)
    assert re.search(r"^Megatron backend:", help_text, re.MULTILINE)
    assert "--fsdp-cpu-offload" not in help_text


def test_every_wheel_says_what_it_needs(wheels):
    """Complete metadata: a description, license, Python range, URLs, classifiers, a README."""
    for name, wheel in wheels.items():
        with zipfile.ZipFile(wheel) as zf:
            meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            meta = Parser().parsestr(zf.read(meta_name).decode())
        assert meta["Summary"], name
        assert meta["Requires-Python"] == ">=3.11", name
        assert meta.get("License") or meta.get("License-Expression"), name
        urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL") or [])
        assert {"Homepage", "Repository", "Documentation", "Changelog"} <= urls.keys(), name
        classifiers = meta.get_all("Classifier") or []
        assert "Programming Language :: Python :: 3.11" in classifiers, name
        assert (meta["Description-Content-Type"] or "").startswith("text/markdown"), name
        assert len(meta.get_payload()) > 200, f"{name}: the README is not the long description"


def test_miles_launch_pulls_no_backend(wheels):
    required = _miles_closure(wheels, "miles-launch")
    assert required == {"miles-launch", "miles-sync", "miles-core"}


def test_the_lock_resolves_from_the_package_index_alone(tmp_path):
    """``uv.lock`` names no machine's paths, and ``uv lock --check`` passes on a bare copy.

    The copy holds only the project files uv reads (no local wheel directory is configured
    anywhere), and uv runs with pip's and uv's find-links settings removed from the environment.
    """
    if UV is None:
        pytest.skip("uv is not installed")
    lock = tomllib.loads((REPO / "uv.lock").read_text())
    for package in lock["package"]:
        source = package["source"]
        if "registry" in source:
            assert source["registry"] == "https://pypi.org/simple", package["name"]
        else:
            assert set(source) <= {"editable", "virtual"}, (package["name"], source)
            assert not Path(next(iter(source.values()))).is_absolute(), package["name"]
    root = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "find-links" not in root["tool"]["uv"]
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    shutil.copy(REPO / "uv.lock", tmp_path)
    for member in [REPO / "native", *sorted((REPO / "packages").iterdir())]:
        dest = tmp_path / member.relative_to(REPO)
        dest.mkdir(parents=True)
        for name in ("pyproject.toml", "README.md"):
            shutil.copy(member / name, dest / name)
    env = {k: v for k, v in _clean_env().items() if not k.startswith(("PIP_", "UV_"))}
    out = subprocess.run(
        [UV, "lock", "--check"], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr
