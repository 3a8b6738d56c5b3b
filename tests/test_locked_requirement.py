"""scripts/locked_requirement.py: the pip requirement CI's megatron-core 0.19 stage installs is
the version and file hashes uv.lock resolves for that interpreter line."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "locked_requirement.py"

spec = importlib.util.spec_from_file_location("locked_requirement", SCRIPT)
locked = importlib.util.module_from_spec(spec)
spec.loader.exec_module(locked)

LOCK = """
[[package]]
name = "lib"
version = "1.0.0"
resolution-markers = ["python_full_version < '3.12'"]
sdist = { url = "https://x/lib-1.0.0.tar.gz", hash = "sha256:aa" }
wheels = [{ url = "https://x/lib-1.0.0-cp311.whl", hash = "sha256:bb" }]

[[package]]
name = "lib"
version = "2.0.0"
resolution-markers = ["python_full_version >= '3.12'"]
wheels = [
    { url = "https://x/lib-2.0.0-cp311.whl", hash = "sha256:dd" },
    { url = "https://x/lib-2.0.0-cp312.whl", hash = "sha256:cc" },
]

[[package]]
name = "plain"
version = "0.1.0"
wheels = [{ url = "https://x/plain.whl", hash = "sha256:ee" }]
"""


def test_the_entry_for_each_interpreter_line_with_every_hash():
    lock = tomllib.loads(LOCK)
    assert locked.requirement(locked.locked_entry(lock, "lib", "3.12")) == (
        "lib==2.0.0 --hash=sha256:cc --hash=sha256:dd"
    )
    assert locked.requirement(locked.locked_entry(lock, "lib", "3.11.7")) == (
        "lib==1.0.0 --hash=sha256:aa --hash=sha256:bb"
    )
    assert locked.requirement(locked.locked_entry(lock, "plain", "3.13")) == (
        "plain==0.1.0 --hash=sha256:ee"
    )


def test_the_real_lock_pins_megatron_core_019_for_python_312():
    lock = tomllib.loads((REPO / "uv.lock").read_text())
    entry = locked.locked_entry(lock, "megatron-core", "3.12")
    assert entry["version"].startswith("0.19."), entry["version"]
    line = locked.requirement(entry)
    assert line.count("--hash=sha256:") == len(entry["wheels"]) + ("sdist" in entry)


def test_an_unknown_package_is_one_line_and_exit_2(tmp_path):
    lock = tmp_path / "uv.lock"
    lock.write_text(LOCK)
    for argv in (["nope", "--lock", lock], ["lib", "--lock", tmp_path / "missing.lock"]):
        run = subprocess.run(
            [sys.executable, str(SCRIPT), *map(str, argv), "--python", "3.12"],
            capture_output=True,
            text=True,
        )
        assert run.returncode == 2
        assert run.stderr.count("\n") == 1 and run.stderr.startswith("error: "), run.stderr
