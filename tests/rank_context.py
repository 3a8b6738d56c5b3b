"""Test support: how tests start their gloo ranks.

A spawned rank is a fresh interpreter that imports torch and the backend before it computes
anything: about 9 CPU-s for the FSDP backend and 17 for the Megatron one (megatron-core pulls in
torch's compiler stack), measured on a 2-core CI machine. With a few dozen multi-rank tests that
was most of what they cost. Ranks are instead forked from a multiprocessing *forkserver* that
imported those modules once (one forkserver per pytest worker, started at its first rank).

What a spawned rank had that a forkserver's child would not, each rank gets back:

- **the environment of the moment** (:func:`in_environ`): the forkserver's environment is the
  one it was started with, so a variable a test set later is carried to the rank with its target;
- **a fresh interpreter's modules**: the forkserver only imports, it never runs a model, starts a
  thread pool or initialises CUDA; what a rank patches (the megatron CPU shim) it patches in its
  own copy.

NCCL ranks (``tests/gpu``) keep ``spawn``: a CUDA rank is not forked from anything.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from typing import Any

#: Imported once by the forkserver. A module that is not installed is skipped (multiprocessing
#: ignores a preload that fails to import).
PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "miles_core.batch",
    "miles_fsdp.backend",
    "miles_megatron.backend",
]


def start_method(backend: str = "gloo") -> str:
    """``forkserver`` for CPU ranks, ``spawn`` for CUDA ranks."""
    return "spawn" if backend == "nccl" else "forkserver"


def rank_context(backend: str = "gloo"):
    """The multiprocessing context to start ``backend`` ranks with."""
    method = start_method(backend)
    if method == "forkserver":
        mp.set_forkserver_preload(PRELOAD)
    return mp.get_context(method)


class _InEnviron:
    """``target`` called in the environment the parent had when it made this (picklable)."""

    def __init__(self, target: Callable, environ: dict[str, str]) -> None:
        self.target = target
        self.environ = environ

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        os.environ.clear()
        os.environ.update(self.environ)
        return self.target(*args, **kwargs)


def in_environ(target: Callable) -> Callable:
    """Wrap a rank's target so that it runs in this process's current environment."""
    return _InEnviron(target, dict(os.environ))
