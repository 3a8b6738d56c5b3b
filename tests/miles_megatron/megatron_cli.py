"""Test support: ``miles train --train-backend megatron`` as a subprocess on CPU. The environment
puts ``cpu_shim_site/`` (its ``sitecustomize`` installs the megatron CPU shim before
``miles_megatron`` is imported) and this directory on ``PYTHONPATH`` of the driver and, through
it, of Ray's trainer actors and the engines."""

from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent


def megatron_cli_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(HERE / "cpu_shim_site"), str(HERE)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])  # e.g. a megatron-core overlay (.ci/run)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env
