"""``torch.load`` of the small state files of a checkpoint, never able to run code.

Every ``*.pt`` a backend writes next to its sharded state (RNG states, the LR schedule, loss
scaler and other extras) is read with :func:`load_state_file`: ``torch.load(weights_only=True)``
with :data:`NUMPY_RNG_GLOBALS` added, the classes ``numpy.random.get_state()`` pickles
(an ``ndarray`` of ``uint32`` and its ``dtype``). A file that names any other global (a
checkpoint planted in a shared directory to run code on load) is refused with
:class:`UnsafeCheckpointFileError`, one line naming the file and the global, before anything
of it is built.
"""

from __future__ import annotations

import os
import pickle
import re
from typing import Any

import numpy as np
import torch


class UnsafeCheckpointFileError(RuntimeError):
    """A checkpoint file needs globals outside the allowlist (the message names the file)."""


def _numpy_rng_globals() -> list:
    """What ``np.random.get_state()`` needs: ``ndarray`` rebuilt by ``_reconstruct``, its dtype."""
    try:
        from numpy._core.multiarray import _reconstruct  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct  # numpy < 2
    extra = [_reconstruct, np.ndarray, np.dtype]
    dtypes = getattr(np, "dtypes", None)  # numpy >= 1.25 pickles dtype classes by name
    if dtypes is not None:
        extra.append(dtypes.UInt32DType)
    return extra


#: Globals a state file may name beyond what ``weights_only=True`` allows by itself.
NUMPY_RNG_GLOBALS: list = _numpy_rng_globals()

_GLOBAL_NAMED = re.compile(r"(?:Unsupported global|GLOBAL) ?:? ?(?:GLOBAL )?([\w.]+)")


def load_state_file(path: str | os.PathLike, map_location: Any = "cpu") -> Any:
    """``torch.load(path, weights_only=True)`` with :data:`NUMPY_RNG_GLOBALS`; an unsafe file
    raises :class:`UnsafeCheckpointFileError` naming ``path``."""
    try:
        with torch.serialization.safe_globals(NUMPY_RNG_GLOBALS):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        match = _GLOBAL_NAMED.search(str(exc))
        what = f"it names {match.group(1)}" if match else "it is not a plain state file"
        raise UnsafeCheckpointFileError(
            f"{path}: refused to load ({what}, outside the allowlist of torch.load "
            "weights_only=True); only load checkpoints you wrote"
        ) from exc
