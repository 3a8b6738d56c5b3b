"""The `miles` CLI, Ray placement, the RL loop and the engines (SGLang or built-in)."""

from importlib.metadata import version as _version

__version__ = _version("miles-launch")
