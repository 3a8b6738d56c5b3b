"""DeviceMover: the sleep/wake of a trainer's models and optimizers.

``sleep()`` moves every parameter, buffer and optimizer state tensor that lives on the
device to the target (pinned host arena, or a file), clears completed-step gradients
instead of moving them, and releases the device memory; ``wake_up()`` brings it back.
Both are idempotent. Copies of a whole sleep (or wake) are enqueued on the copy engine's
own stream after the work already queued on the current stream, with a single
synchronisation at the end; nothing reads a moved tensor before that.

What survives a cycle: Parameter objects (same ``id``), the optimizer's ``param_groups``
and ``state`` keys (same objects), tied weights (one Parameter moves once), FSDP2 sharded
parameters including uneven shards (FSDP's padded shard moves as one block, and
``Module._apply`` lets FSDP re-register its views over the new storage). Buffers and
optimizer state values are replaced by new tensors under ``cpu``, and keep their objects
under ``disk`` (their storage is freed and re-grown).

While asleep, :meth:`DeviceMover.read` gives the values of any tensor the mover holds on the
device without waking anything: a ``cpu`` target's host copy is copied over, a ``disk``
target's bytes are read from its file. A publish from a sleeping trainer reads its weights this
way, one tensor (or one shard) at a time; the optimizer state stays where it is.

Frozen models (reference, teacher) keep their host copy after waking: each later sleep
points them back at it without copying. A model that FSDP2 keeps on the CPU itself
(``CPUOffloadPolicy``) never sleeps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from miles_native import CopyEngine
from torch import nn

from miles_offload.allocation import AllocationFailed, SleepFailed, WakeFailed
from miles_offload.disk_target import DiskStore
from miles_offload.offload_target import OffloadTarget
from miles_offload.pinned_store import PinnedStore
from miles_offload.state_tensors import (
    MovedTensor,
    clear_grads,
    fsdp_cpu_offloaded,
    module_tensors,
    optimizer_tensors,
    rebind_module,
    rebind_optimizer,
    tensor_device,
)

logger = logging.getLogger(__name__)


@dataclass
class MoveStats:
    """The last sleep or wake: bytes copied and wall seconds (including the final sync).

    ``phases``: where the seconds went. Sleep: ``plan`` (finding the tensors, sizing the
    arena), ``copy`` (enqueueing and waiting for the copies), ``rebind`` (pointing the model
    and optimizer at the host copies), ``free`` (returning the cached device memory). Wake:
    ``copy`` (allocating on the device while the copies run) and ``rebind``.
    """

    bytes_copied: int = 0
    seconds: float = 0.0
    new_host_bytes: int = 0  # pinned memory allocated by this call (first sleep, layout change)
    phases: dict[str, float] = field(default_factory=dict)


class _PhaseClock:
    """Adds the wall time spent in each named phase to ``phases``."""

    def __init__(self, phases: dict[str, float]):
        self.phases = phases
        self.name: str | None = None
        self.since = time.perf_counter()

    def switch(self, name: str | None) -> None:
        now = time.perf_counter()
        if self.name is not None:
            self.phases[self.name] = self.phases.get(self.name, 0.0) + now - self.since
        self.name, self.since = name, now

    def stop(self) -> None:
        self.switch(None)


@dataclass
class _Group:
    name: str
    module: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    frozen: bool = False
    store: PinnedStore | DiskStore | None = None
    entries: list[MovedTensor] = field(default_factory=list)


def _infer_device(modules: Iterable[nn.Module]) -> torch.device:
    for m in modules:
        for t in m.parameters():
            return tensor_device(t)
    return torch.device("cpu")


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class DeviceMover:
    """Sleep/wake for ``modules`` (by name) and ``optimizers``.

    ``target``: :class:`OffloadTarget` (``cpu`` or ``disk``). ``frozen``: names in
    ``modules`` whose weights never change. ``device``: the device whose tensors move
    (default: that of the first parameter); tensors elsewhere (e.g. AdamW's CPU step
    counters) stay where they are. Without CUDA, the "device" is the CPU and the same code
    moves the bytes into the arena (or file) and back. ``role``: whose optimizers these are
    (``actor``, ``critic``), for the messages of :class:`~miles_offload.allocation.WakeFailed`
    and :class:`~miles_offload.allocation.SleepFailed`.
    """

    def __init__(
        self,
        modules: Mapping[str, nn.Module],
        optimizers: Sequence[torch.optim.Optimizer] = (),
        target: OffloadTarget | None = None,
        frozen: Iterable[str] = (),
        device: torch.device | str | None = None,
        cpu_copy_threads: int = 2,
        role: str = "trainer",
    ) -> None:
        self.role = role
        frozen = set(frozen)
        unknown = frozen - set(modules)
        if unknown:
            raise ValueError(f"DeviceMover: frozen names {sorted(unknown)} are not in modules")
        self.target = target or OffloadTarget()
        self.device = (
            torch.device(device) if device is not None else _infer_device(modules.values())
        )
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.engine = CopyEngine(
            device=self.device.index or 0 if self.device.type == "cuda" else 0,
            cpu_threads=cpu_copy_threads,
        )
        self._rank = _rank()
        self._groups: list[_Group] = []
        self.skipped: list[str] = []  # natively CPU-offloaded models: never sleep
        for name, module in modules.items():
            if fsdp_cpu_offloaded(module):
                logger.info("%s is CPU-offloaded by FSDP: it never sleeps", name)
                self.skipped.append(name)
                continue
            self._groups.append(_Group(name, module=module, frozen=name in frozen))
        for i, opt in enumerate(optimizers):
            self._groups.append(_Group(f"optimizer{i}", optimizer=opt))
        self.is_asleep = False
        self.last = MoveStats()
        self.wakes = 0  # wake-ups that moved the state back (a publish asleep adds none)
        self._closed = False

    # -- what moves -------------------------------------------------------------------

    def _collect(self, group: _Group) -> list[MovedTensor]:
        if group.module is not None:
            clear_grads(group.module)
            return module_tensors(group.name, group.module, self.device)
        return optimizer_tensors(group.name, group.optimizer, self.device)

    def _uses_disk(self, group: _Group) -> bool:
        return self.target.kind == "disk"

    def _store(self, group: _Group) -> PinnedStore | DiskStore:
        if group.store is None:
            if self._uses_disk(group):
                group.store = DiskStore(self.target, self._rank, group.name)
            else:
                group.store = PinnedStore()
        return group.store

    def _stream(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.current_stream(self.device).cuda_stream
        return 0

    def _synchronize(self) -> None:
        self.engine.synchronize()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # strided fallback copies

    def _rebind(self, group: _Group, values: dict[int, torch.Tensor]) -> None:
        if group.module is not None:
            rebind_module(group.module, values)
        else:
            rebind_optimizer(group.optimizer, values)

    # -- sleep / wake -----------------------------------------------------------------

    @torch.no_grad()
    def sleep(self) -> MoveStats:
        """Move everything to the target and free the device memory. Idempotent."""
        self._check_open()
        if self.is_asleep:
            return self.last
        start = time.perf_counter()
        stats = MoveStats()
        clock = _PhaseClock(stats.phases)
        stream = self._stream()
        pinned: list[tuple[_Group, list[torch.Tensor]]] = []
        for group in self._groups:
            clock.switch("plan")
            group.entries = self._collect(group)
            store = self._store(group)
            if isinstance(store, DiskStore):
                clock.switch("copy")
                stats.bytes_copied += store.sleep(group.entries, self.engine, stream)
                store.holds_current = True
                continue
            try:
                if store.prepare(group.entries):
                    stats.new_host_bytes += store.nbytes
            except AllocationFailed as failed:
                self._synchronize()  # copies of earlier groups into their arenas
                for g in self._groups:
                    g.entries = []
                stage = "parameters and buffers" if group.module is not None else "optimizer state"
                raise SleepFailed(
                    self._role_of(group), stage, failed, self.device
                ) from failed.cause
            clock.switch("copy")
            if store.holds_current:  # a frozen model whose copy is still valid
                views = [store.view(i, e) for i, e in enumerate(group.entries)]
            else:
                views = store.copy_in(group.entries, self.engine, stream)
                stats.bytes_copied += sum(e.nbytes for e in group.entries)
            pinned.append((group, views))
        clock.switch("copy")
        self._synchronize()
        clock.switch("rebind")
        for group, views in pinned:
            values = {id(e.tensor): e.rebuild(v) for e, v in zip(group.entries, views)}
            self._rebind(group, values)
            group.store.holds_current = True
        for group in self._groups:
            group.entries = []
        clock.switch("free")
        self._release_device_cache()
        clock.stop()
        self.is_asleep = True
        stats.seconds = time.perf_counter() - start
        self.last = stats
        return stats

    @torch.no_grad()
    def wake_up(self) -> MoveStats:
        """Bring everything back to the device. Idempotent."""
        self._check_open()
        if not self.is_asleep:
            return self.last
        start = time.perf_counter()
        stats = MoveStats()
        clock = _PhaseClock(stats.phases)
        clock.switch("copy")
        stream = self._stream()
        placed: list[tuple[_Group, list[MovedTensor], list[torch.Tensor]]] = []
        for group in self._groups:
            store = group.store
            try:
                if isinstance(store, DiskStore):
                    stats.bytes_copied += store.wake(self.engine, stream)
                else:
                    entries = self._host_entries(group)
                    fresh = store.copy_out(entries, self.device, self.engine, stream)
                    stats.bytes_copied += sum(e.nbytes for e in entries)
                    placed.append((group, entries, fresh))
            except AllocationFailed as failed:
                placed.clear()  # the error's traceback keeps this frame: drop the tensors now
                fresh = None
                self._undo_wake()
                raise WakeFailed(self._role_of(group), self._stage_of(group, failed.key),
                                 failed, self.device) from failed.cause  # fmt: skip
        for group in self._groups:
            group.store.holds_current = group.frozen
        self._synchronize()
        clock.switch("rebind")
        for group, entries, fresh in placed:
            values = {id(e.tensor): e.rebuild(t) for e, t in zip(entries, fresh)}
            self._rebind(group, values)
        clock.stop()
        self.is_asleep = False
        self.wakes += 1
        stats.seconds = time.perf_counter() - start
        self.last = stats
        return stats

    @torch.no_grad()
    def read(self, t: torch.Tensor, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """``t`` (a plain tensor or a DTensor's local tensor held by one of the mover's
        models or optimizers) with its values on the device, whether asleep or awake;
        ``rows=(begin, end)``: only ``t[begin:end]``, and only those bytes are read.

        Awake, or a tensor that never moved: ``t`` itself (moved to the device if it is
        elsewhere). Asleep: a new device tensor read from the host copy or the disk file; the
        mover stays asleep. A read from pinned host memory is queued on the current stream
        without waiting for it: work queued after it sees the values (the host copy is only
        written again by the next sleep, which waits for the current stream)."""
        self._check_open()
        if not self.is_asleep or t.numel() == 0 or t.untyped_storage().nbytes() > 0:
            if rows is not None:
                t = t[rows[0] : rows[1]]
            pinned = self.device.type == "cuda" and t.device.type == "cpu" and t.is_pinned()
            return t.to(self.device, non_blocking=pinned)
        for group in self._groups:
            if isinstance(group.store, DiskStore) and group.store.holds(t):
                return group.store.read(t, self.device, rows)
        raise ValueError("DeviceMover.read: the tensor is not one this mover put to sleep")

    def _undo_wake(self) -> None:
        """After a wake's allocation failed: every group back to its sleeping state (the
        models still point at their host copies or freed storages: nothing was rebound), the
        device memory the wake took released, so that a later wake can succeed."""
        self._synchronize()  # the copies already enqueued, before their memory goes
        for group in self._groups:
            if isinstance(group.store, DiskStore):
                group.store.release()
        self._release_device_cache()

    def _role_of(self, group: _Group) -> str:
        return group.name if group.module is not None else self.role

    def _stage_of(self, group: _Group, key: str) -> str:
        """``parameters``, ``buffers`` or ``optimizer state`` (``key``: a moved tensor's)."""
        if group.module is None:
            return "optimizer state"
        qual = key.removeprefix(f"{group.name}.")
        params = dict(group.module.named_parameters(remove_duplicate=False))
        return "parameters" if qual in params else "buffers"

    def _host_entries(self, group: _Group) -> list[MovedTensor]:
        """The group's tensors that sit in its arena (tensors that never moved are left out)."""
        cpu = torch.device("cpu")
        if group.module is not None:
            entries = module_tensors(group.name, group.module, cpu)
        else:
            entries = optimizer_tensors(group.name, group.optimizer, cpu)
        return [e for e in entries if e.nbytes == 0 or group.store.owns(e.source)]

    def _release_device_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- bookkeeping ------------------------------------------------------------------

    @property
    def host_bytes(self) -> int:
        """Host memory held: pinned arenas, plus the staging rings of disk files."""
        total = 0
        for g in self._groups:
            if isinstance(g.store, PinnedStore):
                total += g.store.nbytes
            elif isinstance(g.store, DiskStore):
                total += g.store.ring_bytes
        return total

    @property
    def disk_paths(self) -> list[str]:
        return [g.store.path for g in self._groups if isinstance(g.store, DiskStore)]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("DeviceMover is closed")

    def close(self) -> None:
        """Wake up if asleep, then drop the host copies and remove the disk files."""
        if self._closed:
            return
        if self.is_asleep:
            self.wake_up()
        for g in self._groups:
            if g.store is not None:
                g.store.close()
                g.store = None
        self._closed = True
