"""scripts/strip_ray_wheel.py: Ray's wheel without its Java jars still installs, and ``ray.init()``
and a task run from it (what a GPU node that takes wheels by hand relies on to run ``miles
train``). Downloads the locked Ray release's wheel for this interpreter from the package index."""

from __future__ import annotations

import csv
import io
import platform
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.extended]


def _has_pip(python: str) -> bool:
    return subprocess.run([python, "-m", "pip", "--version"], capture_output=True).returncode == 0


def test_stripped_ray_wheel_installs_and_runs(tmp_path):
    import ray

    # uv-made environments have no pip: any pip downloads, for this interpreter's tags
    pip = next(
        (
            p
            for p in (
                sys.executable,
                getattr(sys, "_base_executable", None),
                shutil.which("python3"),
            )
            if p and _has_pip(p)
        ),
        None,
    )
    if pip is None:
        pytest.skip("no pip to download Ray's wheel with")
    tag = f"{sys.version_info.major}{sys.version_info.minor}"
    dl = subprocess.run(
        [pip, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--python-version", tag, "--implementation", "cp", "--abi", f"cp{tag}",
         "--platform", f"manylinux2014_{platform.machine()}", "-d", str(tmp_path / "orig"),
         f"ray=={ray.__version__}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if dl.returncode != 0:
        pytest.skip(f"ray {ray.__version__} wheel not downloadable here: {dl.stderr[-300:]}")
    (wheel,) = (tmp_path / "orig").glob("ray-*.whl")
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts/strip_ray_wheel.py"), str(wheel),
         str(tmp_path / "stripped"), "--check"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "ray.init() and a task ran" in out.stdout
    stripped = tmp_path / "stripped" / wheel.name
    with zipfile.ZipFile(wheel) as a, zipfile.ZipFile(stripped) as b:
        before, after = set(a.namelist()), set(b.namelist())
        assert any(n.startswith("ray/jars/") for n in before)
        assert before - after == {n for n in before if n.startswith("ray/jars/")}
        (record,) = [n for n in after if n.count("/") == 1 and n.endswith(".dist-info/RECORD")]
        rows = list(csv.reader(io.StringIO(b.read(record).decode())))
        assert {r[0] for r in rows if r} == after  # RECORD lists exactly what the wheel holds
    assert stripped.stat().st_size < 0.7 * wheel.stat().st_size
