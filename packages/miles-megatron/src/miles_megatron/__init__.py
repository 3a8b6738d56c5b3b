"""megatron-core training backend: TP/PP/CP/EP/ETP and torch_dist checkpoints."""

from importlib.metadata import version as _version

__version__ = _version("miles-megatron")
