"""miles-native: compiled helpers (pinned arena, copy engine, file streamer) and Triton kernels."""

from importlib.metadata import version as _version

from miles_native._core import build_info, built_with_cuda

__version__ = _version("miles-native")
__all__ = ["build_info", "built_with_cuda", "__version__"]
