"""Bridge registry: ``model_type`` -> bridge; new families register a plugin.

A plugin package registers its bridge either by importing :func:`register_bridge` (as the
built-in families do) or through the ``miles.megatron_bridges`` entry point group, whose objects
are :class:`~miles_megatron.bridge.base.Bridge` subclasses::

    [project.entry-points."miles.megatron_bridges"]
    my_family = "my_pkg.bridge:MyFamilyBridge"
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from miles_megatron.bridge.base import BridgeError

if TYPE_CHECKING:
    from miles_megatron.bridge.base import Bridge

ENTRY_POINT_GROUP = "miles.megatron_bridges"

_BRIDGES: dict[str, type[Bridge]] = {}


def register_bridge(cls: type[Bridge]) -> type[Bridge]:
    """Class decorator: register ``cls`` for each of its ``model_types``."""
    if not cls.model_types:
        raise ValueError(f"{cls.__qualname__}.model_types is empty")
    for model_type in cls.model_types:
        _BRIDGES[model_type] = cls
    return cls


def _load_entry_points() -> None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        register_bridge(ep.load())


def registered_model_types() -> list[str]:
    import miles_megatron.bridge.families  # noqa: F401  (registers the built-ins)

    _load_entry_points()
    return sorted(_BRIDGES)


def bridge_for(model_type: str) -> Bridge:
    """A bridge instance for ``model_type``; a clear error naming the known families."""
    known = registered_model_types()
    if model_type not in _BRIDGES:
        raise BridgeError(
            f"config.json: model_type {model_type!r} has no megatron bridge "
            f"(bridged: {', '.join(known)}; register one with miles_megatron.bridge.register_bridge)"
        )
    return _BRIDGES[model_type]()
