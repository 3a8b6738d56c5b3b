"""Sleep/wake device mover, disk offload target and the streamed optimizer."""

from importlib.metadata import version as _version

__version__ = _version("miles-offload")
