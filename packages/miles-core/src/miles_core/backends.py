"""The backend registry: training backends are found through the ``miles.backends`` entry points.

``miles_core`` imports no backend: ``load("fsdp")`` imports ``miles_fsdp`` only when asked, so an
FSDP run never imports megatron-core and the reverse.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from miles_core.contract import TrainBackend

ENTRY_POINT_GROUP = "miles.backends"

#: The distribution that provides each known backend, for the "pip install" hint.
KNOWN_BACKENDS: dict[str, str] = {"megatron": "miles-megatron", "fsdp": "miles-fsdp"}


class BackendNotInstalledError(ImportError):
    """The requested backend's package is not installed."""


def available() -> list[str]:
    """Names of the backends whose packages are installed."""
    return sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))


def load(name: str) -> type[TrainBackend]:
    """Return the backend class registered under ``name``.

    Raises :class:`BackendNotInstalledError` naming the package to install when the backend is
    known but absent, and :class:`ValueError` for a name no package provides.
    """
    matches = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not matches:
        if name in KNOWN_BACKENDS:
            dist = KNOWN_BACKENDS[name]
            raise BackendNotInstalledError(
                f"training backend '{name}' is not installed: pip install {dist}"
            )
        known = ", ".join(sorted(set(KNOWN_BACKENDS) | set(available())))
        raise ValueError(f"unknown training backend '{name}' (known: {known})")
    cls = matches[0].load()
    if not (isinstance(cls, type) and issubclass(cls, TrainBackend)):
        raise TypeError(
            f"entry point {matches[0].value} for backend '{name}' is not a TrainBackend"
        )
    return cls
