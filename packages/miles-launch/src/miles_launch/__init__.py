"""The `miles` CLI, Ray placement, the RL loop and the engines (SGLang or built-in)."""

import os as _os
from importlib.metadata import version as _version

# Ray reads this when it is first imported, and the package's modules import ray at their top,
# so it is set here, before any of them: under `uv run`, Ray would otherwise package the working
# directory and have every worker build a fresh virtual environment from it (minutes, and
# without a package index the workers die at start); the workers use this interpreter as it is.
_os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

__version__ = _version("miles-launch")
