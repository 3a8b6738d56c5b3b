"""Sleep/wake device mover, disk offload target and the streamed optimizer.

``DeviceMover(modules, optimizers, target, frozen)`` with ``sleep()`` / ``wake_up()`` /
``close()``; ``OffloadTarget("cpu" | "disk", ...)``. See docs/miles-offload.md.
"""

from importlib.metadata import version as _version

from miles_offload.device_mover import DeviceMover, MoveStats
from miles_offload.offload_target import OffloadTarget

__version__ = _version("miles-offload")
__all__ = ["DeviceMover", "MoveStats", "OffloadTarget", "__version__"]
