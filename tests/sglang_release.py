"""The released SGLang package the conformance tests run as code: fetched, unpacked, importable.

One variable names the release: :data:`SGLANG_VERSION` (``MILES_SGLANG_VERSION`` overrides it,
to re-run the harness against another release); :data:`ROUTER_VERSION` names the
``sglang-router`` release whose argument parser router command lines are checked with
(``MILES_SGLANG_ROUTER_VERSION``). Each wheel is fetched once with
``pip download --no-deps <name>==<version>`` into ``~/.cache/miles/<name>-<version>/``
(``MILES_SGLANG_CACHE`` replaces ``~/.cache/miles``) and unpacked there; later runs reuse it.

sglang cannot be installed with its dependencies on a machine without CUDA, but the modules of
its server's API layer import on a CPU from the unpacked wheel, given the few pure-Python
packages they import (:data:`NEEDED_MODULES`, in the root pyproject's ``dev`` group):

* ``sglang.srt.server_args`` (the server's own argument parser),
* ``sglang.srt.utils.common`` (``init_custom_process_group``, ``MultiprocessingSerializer``),
* ``sglang.srt.weight_sync.tensor_bucket`` (``FlattenedTensorBucket``),
* ``sglang.srt.utils.patch_torch`` (``monkey_patch_torch_reductions``).

:func:`register` makes ``import sglang.srt...`` resolve to the unpacked wheel without running
the top-level ``sglang/__init__.py``, which loads the frontend language (``sglang.lang``) and
transformers patches that none of these modules need (and that would add a dozen more
packages, IPython among them, and ~15 s to every import). Every module under ``sglang.srt``
runs unchanged.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SGLANG_VERSION = os.environ.get("MILES_SGLANG_VERSION", "0.5.23")
ROUTER_VERSION = os.environ.get("MILES_SGLANG_ROUTER_VERSION", "0.3.2")

#: Modules the API-layer modules import that the workspace does not already provide.
NEEDED_MODULES = ("orjson", "pybase64", "msgspec", "zmq")


class Unavailable(Exception):
    """The release cannot be fetched here (no package index) or its imports are missing."""


def cache_dir(name: str, version: str) -> Path:
    root = os.environ.get("MILES_SGLANG_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "miles") / f"{name}-{version}"


def pip_command() -> list[str]:
    """The pip that ``scripts/extract_sglang_schema.py`` fetches with (one definition)."""
    module = sys.modules.get("extract_sglang_schema")
    if module is None:
        script = Path(__file__).resolve().parents[1] / "scripts" / "extract_sglang_schema.py"
        spec = importlib.util.spec_from_file_location("extract_sglang_schema", script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    pip = module.pip_command()
    if pip is None:
        raise Unavailable("no pip to fetch it with (install pip or uv)")
    return pip


def fetch(name: str = "sglang", version: str = SGLANG_VERSION, timeout: float = 300.0) -> Path:
    """The unpacked wheel's root (the directory holding the package), fetched if needed."""
    root = cache_dir(name, version)
    unpacked = root / "unpacked"
    if unpacked.is_dir():
        return unpacked
    root.mkdir(parents=True, exist_ok=True)
    stem = name.replace("-", "_")
    wheels = sorted(root.glob(f"{stem}-{version}-*.whl"))
    if not wheels:
        cmd = [*pip_command(), "download", "--no-deps", "--only-binary", ":all:"]
        cmd += ["--quiet", "--disable-pip-version-check", f"{name}=={version}", "-d", str(root)]
        cmd += ["--python-version", "3.11"]  # sglang's wheels are per CPython minor
        cmd += ["--retries", "1", "--timeout", "10"]  # without an index: skip in seconds
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as error:
            raise Unavailable(f"pip download timed out after {timeout:.0f} s") from error
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise Unavailable(f"pip download failed (no package index reachable?): {last}")
        wheels = sorted(root.glob(f"{stem}-{version}-*.whl"))
        if not wheels:
            raise Unavailable(f"pip download left no {name}-{version} wheel in {root}")
    scratch = Path(tempfile.mkdtemp(prefix="unpacking-", dir=root))
    with zipfile.ZipFile(wheels[-1]) as wheel:
        wheel.extractall(scratch)
    try:
        scratch.rename(unpacked)  # atomic: a concurrent run sees all of it or none
    except OSError:  # another run unpacked it first
        shutil.rmtree(scratch, ignore_errors=True)
    return unpacked


def wheel(name: str = "sglang", version: str = SGLANG_VERSION) -> Path:
    """The cached wheel file (after :func:`fetch`)."""
    stem = name.replace("-", "_")
    wheels = sorted(cache_dir(name, version).glob(f"{stem}-{version}-*.whl"))
    if not wheels:
        raise Unavailable(f"no {name}-{version} wheel in {cache_dir(name, version)}")
    return wheels[-1]


def missing_modules() -> list[str]:
    return [name for name in NEEDED_MODULES if importlib.util.find_spec(name) is None]


def register(root: Path | str) -> None:
    """Make ``sglang`` (and its ``importlib.metadata`` version) resolve to the unpacked release
    at ``root`` in this process, without running ``sglang/__init__.py`` (see the module doc)."""
    root = Path(root)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))  # also finds sglang-<version>.dist-info
    package = root / "sglang"
    spec = importlib.machinery.ModuleSpec(
        "sglang", loader=None, origin=str(package / "__init__.py"), is_package=True
    )
    spec.submodule_search_locations = [str(package)]
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(package / "__init__.py")
    sys.modules["sglang"] = module


def python_with_sglang(root: Path | str) -> list[str]:
    """The command prefix that runs ``python -m MODULE ...`` with the release registered
    (``[*python_with_sglang(root), "miles_launch.train", ...]``)."""
    here = Path(__file__).resolve().parent
    return [sys.executable, str(here / "sglang_conformance" / "run_with_sglang.py"), str(root)]
