"""The allocations a sleep or a wake makes, and the one error each raises when one fails.

A wake allocates the device memory of everything that slept (a new tensor per moved tensor, or
a freed storage grown back); a sleep allocates the host copy (a pinned arena). When the
allocator refuses, the call raises :class:`WakeFailed` or :class:`SleepFailed`: the phase, the
role whose state was moving (actor, critic, ref, ...), the stage (parameters, buffers,
optimizer state, gradients), the tensor, the bytes asked and what the device had free and held.
The mover that raises it has undone its partial work first: a failed wake leaves the state
asleep and restorable (what came back is released again, so a later wake can succeed), a failed
sleep leaves it awake and intact.

``fault_hook`` is for tests: called with the bytes of each allocation below before it is made,
it can raise the allocator's error (``torch.OutOfMemoryError``) so that the real sleep or wake
runs up to a failing allocation on any device.
"""

from __future__ import annotations

import errno
from collections.abc import Callable

import torch
from miles_native import PinnedArena

#: Tests only: ``fault_hook(nbytes)`` runs before each allocation of a sleep or a wake.
fault_hook: Callable[[int], None] | None = None


class AllocationFailed(Exception):
    """One allocation of a move failed: ``key`` (the tensor), ``nbytes`` asked, ``cause``."""

    def __init__(self, key: str, nbytes: int, cause: BaseException) -> None:
        super().__init__(f"{key}: {nbytes} bytes: {cause}")
        self.key, self.nbytes, self.cause = key, nbytes, cause


class MoveFailed(RuntimeError):
    """A sleep or a wake could not allocate what it moves (module docstring)."""

    phase = "move"

    def __init__(
        self, role: str, stage: str, failed: AllocationFailed, device: torch.device | None
    ) -> None:
        self.role, self.stage, self.key, self.nbytes = role, stage, failed.key, failed.nbytes
        held = memory_report(device) if self.phase == "wake" else ""
        after = (
            "the state stays asleep and a later wake can retry"
            if self.phase == "wake"
            else "the state stays awake and intact"
        )
        first = str(failed.cause).strip().splitlines()[0] if str(failed.cause).strip() else ""
        super().__init__(
            f"{self.phase} of {role} failed allocating its {stage} ({failed.key}): "
            f"{format_bytes(failed.nbytes)} asked{held}; {after} "
            f"({type(failed.cause).__name__}: {first[:200]})"
        )

    def __reduce__(self):
        # a trainer rank's error crosses processes (Ray pickles it): keep message and fields
        fields = (str(self), self.role, self.stage, self.key, self.nbytes)
        return (_rebuild, (type(self), *fields))


def _rebuild(cls: type[MoveFailed], message: str, role, stage, key, nbytes) -> MoveFailed:
    error = cls.__new__(cls)
    RuntimeError.__init__(error, message)
    error.role, error.stage, error.key, error.nbytes = role, stage, key, nbytes
    return error


class WakeFailed(MoveFailed):
    """A wake's device allocation failed; the state is asleep and restorable."""

    phase = "wake"


class SleepFailed(MoveFailed):
    """A sleep's host allocation failed; the state is awake and intact."""

    phase = "sleep"


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit} ({n} bytes)"
    return f"{n} bytes"


def memory_report(device: torch.device | None) -> str:
    """``, F free of T on DEV, H held by this process`` on CUDA; empty elsewhere."""
    if device is None or device.type != "cuda":
        return ""
    try:
        free, total = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_reserved(device)
    except RuntimeError:
        return ""
    return (
        f", {format_bytes(free)} free of {format_bytes(total)} on {device}, "
        f"{format_bytes(held)} held by this process"
    )


def _fault(nbytes: int) -> None:
    if fault_hook is not None:
        fault_hook(nbytes)


def allocate(key: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` on ``device``; the allocator's refusal -> :class:`AllocationFailed`."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    try:
        _fault(nbytes)
        return torch.empty(shape, dtype=dtype, device=device)
    except torch.OutOfMemoryError as error:
        raise AllocationFailed(key, nbytes, error) from error


def grow(key: str, storage: torch.UntypedStorage, nbytes: int) -> None:
    """``storage.resize_(nbytes)`` (a freed storage grown back); refusal -> AllocationFailed."""
    try:
        _fault(nbytes)
        storage.resize_(nbytes)
    except torch.OutOfMemoryError as error:
        raise AllocationFailed(key, nbytes, error) from error


def pinned_arena(key: str, nbytes: int) -> PinnedArena:
    """A pinned host arena of ``nbytes``; ENOMEM (or the hook's error) -> AllocationFailed."""
    try:
        _fault(nbytes)
        return PinnedArena(nbytes, pin=True)
    except torch.OutOfMemoryError as error:
        raise AllocationFailed(key, nbytes, error) from error
    except OSError as error:
        if error.errno != errno.ENOMEM:
            raise
        raise AllocationFailed(key, nbytes, error) from error
