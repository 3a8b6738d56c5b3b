"""Ray reads ``RAY_ENABLE_UV_RUN_RUNTIME_ENV`` when it is first imported; under ``uv run`` (how
CI and the README run everything) a Ray that has it on packages the working directory and has
each worker build a virtual environment from it, and without a package index the workers die at
start and a job waits for its engines forever. The launcher's modules import ray at their top,
so importing any of them must leave ray with the setting off."""

import os
import subprocess
import sys

PROGRAM = """
import miles_launch.job  # imports ray at its top (through the engine set and the trainer group)
import sys
assert "ray" in sys.modules, "coverage: ray was imported through the job module"
from ray._private import ray_constants
print(ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV)
"""


def test_the_job_module_imports_ray_with_uv_run_workers_off():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_UV_RUN_RUNTIME_ENV"}
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout
