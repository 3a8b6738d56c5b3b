"""FSDP2 training backend: the HuggingFace model trained verbatim."""

from importlib.metadata import version as _version

__version__ = _version("miles-fsdp")
