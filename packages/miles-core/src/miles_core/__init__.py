"""Contract, argument groups, rollout batch, RL math, packing, checkpoint layout and the engine client."""

from importlib.metadata import version as _version

__version__ = _version("miles-core")
