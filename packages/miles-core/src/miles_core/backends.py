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
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def load(name: str) -> type[TrainBackend]:
    """Return the backend class registered under ``name``.

    Raises :class:`BackendNotInstalledError` naming the package to install when the backend is
    known but absent (or its package imports a dependency that is absent), :class:`ValueError`
    for a name no package provides, and :class:`TypeError` when the entry point is not a
    :class:`TrainBackend` subclass.
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
    targets = sorted({ep.value for ep in matches})
    if len(targets) > 1:
        raise RuntimeError(
            f"training backend '{name}' is registered by several installed packages "
            f"({', '.join(targets)}); uninstall all but one"
        )
    entry = matches[0]
    try:
        cls = entry.load()
    except ImportError as exc:
        # The backend's package is there but one of its own dependencies is not
        # (e.g. miles-megatron without megatron-core).
        raise BackendNotInstalledError(
            f"training backend '{name}' ({entry.value}) failed to import: {exc}"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, TrainBackend)):
        raise TypeError(f"entry point {entry.value} for backend '{name}' is not a TrainBackend")
    return cls
