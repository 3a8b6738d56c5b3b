"""``--compile-decoder-layers``: each decoder layer's ``forward`` through ``torch.compile``
(inductor), guarded so that a layer whose compilation fails runs eagerly and the run goes on.
Both backends use it: FSDP on the HF model's decoder layers, Megatron on its ``TransformerLayer``
modules (every role's, and every pipeline stage's own).

Only ``forward`` is compiled, not the module's call: the wrappers around a layer (FSDP2's
per-layer hooks, HF gradient checkpointing, Megatron's activation recompute) run eagerly around
the compiled forward, exactly as they do around the eager one. A backend's decoder layers are
one class, so they share one compiled code object: the layers compile once, not once each. What
inductor fuses is the elementwise work between the matmuls: the norms, RoPE, SiLU x mul, residual
adds and dtype casts. Attention stays outside the graph (each backend's attention function is
excluded with ``torch.compiler.disable``): the layer runs as two graphs, before and after
attention, and the varlen kernel's per-micro-batch boundaries never cause a recompile.

The guard: a compilation happens at a layer's first call (and again where a new shape or grad mode
asks for it); the backward is lowered in the same call (``force_non_lazy_backward_lowering``), so
a failing compiler fails inside the guard rather than in ``backward()``. When the compiled call
raises, the layer's eager forward runs the same inputs; if that succeeds the failure was the
compiler's: one warning line names the layer and the reason, and the layer stays eager for the
rest of the run. If the eager forward raises too, the error is the model's and propagates.
Non-reentrant gradient checkpointing stops a layer's recomputation early by raising its own
control-flow exception from a saved-tensor hook (``_StopRecomputationError``): that one is no
failure and passes through the guard untouched (treating it as one reran the layer eagerly
inside a stopped recomputation, which torch's checkpoint rejects).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

#: the compiler backend (inductor: generated Triton kernels on GPU, C++ on CPU)
BACKEND = "inductor"

#: exceptions that are control flow, not a compiler's failure: the guard re-raises them
#: (non-reentrant checkpointing's early stop of a recomputation; absent from older torch)
PASS_THROUGH: tuple[type[BaseException], ...] = tuple(
    cls
    for cls in (getattr(torch.utils.checkpoint, "_StopRecomputationError", None),)
    if isinstance(cls, type)
)


def _reason(error: BaseException) -> str:
    """The compiler's own error (dynamo wraps it in ``BackendCompilerFailed``): its type and
    first line, for one warning line."""
    error = getattr(error, "inner_exception", None) or error
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")


class GuardedForward:
    """A layer's forward that calls the compiled version until it fails, then the eager one."""

    def __init__(self, eager: Callable[..., Any], name: str) -> None:
        self.eager = eager
        self.name = name
        self.compiled: Callable[..., Any] | None = torch.compile(eager, backend=BACKEND)
        #: why the compiled forward was dropped (``None``: it still runs)
        self.failure: str | None = None
        #: calls that ran the compiled forward (coverage for tests and logs)
        self.compiled_calls = 0
        functools.update_wrapper(self, eager)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled is None:
            return self.eager(*args, **kwargs)
        try:
            with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                out = self.compiled(*args, **kwargs)
        except PASS_THROUGH:
            raise
        except Exception as error:
            out = self.eager(*args, **kwargs)  # raises the model's own error, if it has one
            self.compiled = None
            self.failure = _reason(error)
            logger.warning(
                "--compile-decoder-layers: %s runs eagerly, its compilation failed (%s)",
                self.name,
                self.failure,
            )
            return out
        self.compiled_calls += 1
        return out


def compile_layers(layers: Sequence[nn.Module]) -> list[GuardedForward]:
    """Replace the ``forward`` of each of ``layers`` (a model's decoder layers, in order) with a
    :class:`GuardedForward` (compiled lazily, at the first call); returns them in layer order."""
    guarded = []
    for index, layer in enumerate(layers):
        forward = GuardedForward(layer.forward, f"decoder layer {index} ({type(layer).__name__})")
        layer.forward = forward  # an instance attribute: nn.Module's call reads self.forward
        guarded.append(forward)
    return guarded


def guarded_forwards(model: nn.Module) -> list[GuardedForward]:
    """The :class:`GuardedForward` of each decoder layer of ``model``, in layer order (empty:
    not compiled)."""
    return [
        forward
        for module in model.modules()
        if isinstance(forward := module.__dict__.get("forward"), GuardedForward)
    ]


def coverage(model: nn.Module) -> str | None:
    """One line saying how many of ``model``'s decoder layers ran compiled and why the others
    did not (``None``: the layers are not compiled)."""
    guarded = guarded_forwards(model)
    if not guarded:
        return None
    failed = sorted({g.failure for g in guarded if g.failure is not None})
    ran = sum(g.failure is None and g.compiled_calls > 0 for g in guarded)
    return f"{ran} of {len(guarded)} decoder layers ran compiled; failures: {failed}"
