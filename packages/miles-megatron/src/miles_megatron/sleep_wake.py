"""Sleep/wake of the megatron model and distributed optimizer (``--offload-train``).

Megatron's DDP keeps parameters and gradients in contiguous buffers that parameters,
``main_grad`` and the distributed optimizer's shards are *views* of, so nothing may be
re-allocated: the memory is released by shrinking each storage to zero bytes and grown back
on wake, which keeps every view valid (megatron-core's own ``offload_to_cpu`` /
``reload_from_cpu`` of its buffers works the same way). What moves, per storage:

* parameter buffers: their bytes go to the target and come back;
* gradient buffers: freed, re-grown zeroed (a sleep happens between optimizer steps);
* optimizer state (Adam moments, fp32 master shards that are not views of a DDP buffer):
  their bytes go to the target and come back.

The bytes go through miles-offload's stores (``--offload-train-target``): ``cpu`` is one
pinned arena per rank (:class:`~miles_offload.pinned_store.PinnedStore`, sized at the first
sleep and reused), ``disk`` one file per rank under ``--offload-train-disk-dir``
(:class:`~miles_offload.disk_target.DiskStore`: device -> pinned ring -> file with O_DIRECT,
host memory = the ring). A sleep writes everything before it frees anything, so a failed
write (ENOSPC, EIO) raises with the file and offset and leaves the model awake and intact.

``--rematerialize-param-from-master-weight`` (cpu target): the 16-bit parameter buffers are
not copied at all. On wake they are re-grown, zeroed, and rebuilt from the fp32 master shards
(which came back with the optimizer state): each rank casts its shards into its part of the
buffer (megatron's ``_copy_main_params_to_model_params``, the same cast as after a step) and
DDP all-gathers the buffer over the data-parallel group (``start_param_sync``). A parameter
is always the cast of its master after a step, so the rebuilt buffer is bit-identical. fp32
parameter buffers hold their own masters and are copied as usual.

Frozen parameters (the LoRA base, outside the DDP buffers) are copied to pinned host memory
on the first sleep only and *retained* there, whatever the target: every sleep frees their
storage and every wake copies the retained copy back, so after the first cycle only what trains
(adapters, their gradients and optimizer state) travels. ``host_bytes_copied`` counts the bytes
the last sleep copied off the device.

Both calls are idempotent. A wake whose device allocation fails raises
:class:`~miles_offload.allocation.WakeFailed` (the role, the stage: parameters, gradients,
optimizer state or frozen parameters, the tensor and the bytes asked) after freeing what it had
grown again: the state stays asleep, its bytes on the target, and a later wake can succeed.

While asleep, :meth:`SleepWake.read` gives one parameter's values on the device without waking:
a view of the arena slot (``cpu``) or a read of the file's window (``disk``), copied over. A
publish from a sleeping trainer gathers its weights this way, tensor by tensor, and the
optimizer state stays on the target. Under ``--rematerialize-param-from-master-weight`` the
16-bit values exist nowhere while asleep: a read rebuilds the DDP bucket that holds the tensor
on the device, as a wake does (each rank casts its fp32 master shards, read from the arena, and
the bucket is all-gathered over its group), so the device holds one bucket at a time.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from miles_native import CopyEngine
from miles_offload.allocation import AllocationFailed, SleepFailed, WakeFailed, grow
from miles_offload.disk_target import DiskStore
from miles_offload.offload_target import OffloadTarget
from miles_offload.pinned_store import PinnedStore
from miles_offload.state_tensors import MovedTensor, byte_window, from_window

from miles_megatron.optimizer import distributed_optimizers

_HALF = (torch.bfloat16, torch.float16)


def _buffers(model) -> list:
    return list(model.buffers) + list(getattr(model, "expert_parallel_buffers", []))


def _optimizer_tensors(optimizer) -> Iterator[torch.Tensor]:
    for opt in distributed_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            yield from group["params"]
        for state in inner.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    yield value


def _whole_storage(t: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` tensor over all of ``t``'s storage."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class SleepWake:
    """Releases and restores the device memory of a DDP model and its optimizer.

    ``target``: where the bytes go (default: pinned host memory). ``rematerialize``: rebuild
    the 16-bit parameter buffers from the fp32 masters instead of copying them (cpu target).
    """

    def __init__(
        self,
        model,
        optimizer,
        target: OffloadTarget | None = None,
        rematerialize: bool = False,
        name: str = "megatron",
        role: str | None = None,
    ) -> None:
        self.model = model
        self.name = name  # the disk file's tag: one per role in a process (actor, critic)
        self.role = role or name  # for messages
        self.optimizer = optimizer
        self.target = target or OffloadTarget()
        if rematerialize and self.target.kind != "cpu":
            raise ValueError("rematerialize needs the cpu offload target")
        self.rematerialize = rematerialize
        self.asleep = False
        self.device = _buffers(model)[0].param_data.device if _buffers(model) else None
        on_cuda = self.device is not None and self.device.type == "cuda"
        self.engine = CopyEngine(device=(self.device.index or 0) if on_cuda else 0)
        self._store: PinnedStore | DiskStore | None = None  # opened at the first sleep
        self._moved: list[tuple[torch.UntypedStorage, int]] = []  # (storage, bytes) with data
        self._freed: list[tuple[torch.UntypedStorage, int]] = []  # grads and rematerialized
        self._keys: list[str] = []  # for messages: the keys of `_moved`, then of `_freed`
        self._views: list[torch.Tensor] = []  # cpu target: the arena slots of `_moved`
        #: frozen parameters: (parameter, retained host copy, bytes), filled at the first sleep
        self._frozen: list[tuple[torch.Tensor, torch.Tensor, int]] | None = None
        self.host_bytes_copied = 0
        self.wakes = 0  # wake-ups that moved the state back (a publish asleep adds none)
        self._bucket: tuple | None = None  # (DDP bucket, its rebuilt 16-bit values), remat

    @property
    def store(self) -> PinnedStore | DiskStore:
        if self._store is None:
            disk = self.target.kind == "disk"
            self._store = DiskStore(self.target, _rank(), self.name) if disk else PinnedStore()
        return self._store

    # -- what moves -------------------------------------------------------------------

    def _plan(self) -> tuple[list[MovedTensor], list[MovedTensor]]:
        """``(entries whose bytes move, entries only freed)``, one per distinct storage."""
        moved: list[MovedTensor] = []
        freed: list[MovedTensor] = []
        seen: set[int] = set()

        def new(t: torch.Tensor | None) -> bool:
            if t is None or t.device != self.device or t.untyped_storage().nbytes() == 0:
                return False  # absent, already on the host (CPU-offloaded optimizer), or freed
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                return False
            seen.add(ptr)
            return True

        for i, buffer in enumerate(_buffers(self.model)):
            param = buffer.param_data
            if new(param):
                if self.rematerialize and param.dtype in _HALF:
                    freed.append(MovedTensor(f"buffer{i}.param_data", param, param))
                else:
                    flat = _whole_storage(param)
                    moved.append(MovedTensor(f"buffer{i}.param_data", flat, flat))
            if new(buffer.grad_data):
                grad = buffer.grad_data
                freed.append(MovedTensor(f"buffer{i}.grad_data", grad, grad))
        for k, t in enumerate(_optimizer_tensors(self.optimizer)):
            if new(t):
                flat = _whole_storage(t)
                moved.append(MovedTensor(f"optimizer.tensor{k}", flat, flat))
        return moved, freed

    def _frozen_params(self) -> list[torch.Tensor]:
        """Parameters that do not train and live outside the DDP buffers, one per storage."""
        taken = {
            t.untyped_storage().data_ptr()
            for b in _buffers(self.model)
            for t in (b.param_data, b.grad_data)
            if t is not None
        }
        out = []
        for param in self.model.parameters():
            storage = param.untyped_storage()
            if param.requires_grad or storage.data_ptr() in taken or storage.nbytes() == 0:
                continue
            taken.add(storage.data_ptr())
            out.append(param)
        return out

    def _sleep_frozen(self) -> None:
        """Free the frozen parameters; the first sleep keeps their host copy for every wake."""
        if self._frozen is None:
            self._frozen = []
            for param in self._frozen_params():
                host = torch.empty(param.shape, dtype=param.dtype, pin_memory=param.is_cuda)
                host.copy_(param.detach())
                nbytes = param.untyped_storage().nbytes()
                self.host_bytes_copied += nbytes
                self._frozen.append((param, host, nbytes))
        for param, _, _ in self._frozen:
            param.untyped_storage().resize_(0)

    def _wake_frozen(self) -> None:
        for i, (param, host, nbytes) in enumerate(self._frozen or []):
            grow(f"frozen{i}", param.untyped_storage(), nbytes)
            param.detach().copy_(host)

    def _stream(self) -> int:
        if self.device is not None and self.device.type == "cuda":
            return torch.cuda.current_stream(self.device).cuda_stream
        return 0

    def _sync(self) -> None:
        self.engine.synchronize()
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # -- sleep / wake -----------------------------------------------------------------

    @torch.no_grad()
    def sleep(self) -> None:
        """Write the state to the target, then free every storage. Idempotent."""
        if self.asleep:
            return
        moved, freed = self._plan()
        stream = self._stream()
        self.host_bytes_copied = sum(e.nbytes for e in moved)
        if isinstance(self.store, DiskStore):
            self.store.sleep(moved, self.engine, stream)  # writes all, then frees `moved`
            self._views = []
        else:
            try:
                self.store.prepare(moved)
            except AllocationFailed as failed:  # nothing was freed yet
                stage = "parameters and optimizer state"
                raise SleepFailed(self.role, stage, failed, self.device) from failed.cause
            self._views = self.store.copy_in(moved, self.engine, stream)
            self._sync()
            for e in moved:
                e.source.untyped_storage().resize_(0)
        self._moved = [(e.source.untyped_storage(), e.nbytes) for e in moved]
        self._freed = [(e.source.untyped_storage(), e.nbytes) for e in freed]
        self._keys = [e.key for e in moved + freed]
        for storage, _ in self._freed:
            storage.resize_(0)
        self._sleep_frozen()
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.asleep = True

    @torch.no_grad()
    def wake_up(self) -> None:
        """Re-grow every storage and bring its bytes back. Idempotent."""
        if not self.asleep:
            return
        self._bucket = None
        stream = self._stream()
        try:
            if isinstance(self.store, DiskStore):
                self.store.wake(self.engine, stream)
            else:
                for (storage, nbytes), key in zip(self._moved, self._keys):
                    grow(key, storage, nbytes)
                dst = [storage.data_ptr() for storage, _ in self._moved]
                src = [v.data_ptr() for v in self._views]
                sizes = [n for _, n in self._moved]
                self.engine.submit(dst, src, sizes, to_device=True, after_stream=stream)
            for (storage, nbytes), key in zip(self._freed, self._keys[len(self._moved) :]):
                grow(key, storage, nbytes)
            self._wake_frozen()
        except AllocationFailed as failed:
            self._undo_wake()
            raise WakeFailed(self.role, _stage(failed.key), failed, self.device) from failed.cause
        self._sync()
        for buffer in _buffers(self.model):
            if buffer.grad_data is not None:
                buffer.grad_data.zero_()
        if self.rematerialize:
            self._rebuild_params()
        self._moved, self._freed, self._views = [], [], []
        self.asleep = False
        self.wakes += 1

    def _undo_wake(self) -> None:
        """After a failed wake: free every storage the wake grew (the copies into them
        finished first); the bytes are still on the target, the state is asleep."""
        self._sync()
        for storage, _ in self._moved + self._freed:
            storage.resize_(0)
        for param, _, _ in self._frozen or []:
            param.untyped_storage().resize_(0)
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.no_grad()
    def read(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a parameter of the model, or a view of one) with its values on the device:
        ``t`` itself when awake, else a new tensor from the host copy or the file."""
        storage = t.untyped_storage()
        if not self.asleep or t.numel() == 0 or storage.nbytes() > 0:
            return t
        key = storage._cdata
        if self.rematerialize:
            rebuilt = self._read_rematerialized(t)
            if rebuilt is not None:
                return rebuilt
        for param, host, _ in self._frozen or []:
            if param.untyped_storage()._cdata == key:
                return host.as_strided(t.shape, t.stride(), t.storage_offset()).to(self.device)
        if isinstance(self.store, DiskStore):
            if self.store.holds(t):
                return self.store.read(t, self.device)
        else:
            for (moved, _), view in zip(self._moved, self._views):
                if moved._cdata == key:
                    begin, nbytes = byte_window(t)
                    return from_window(view[begin : begin + nbytes], t, self.device)
        raise ValueError("SleepWake.read: the tensor's bytes are not held while asleep")

    def _read_rematerialized(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t`` in a freed 16-bit parameter buffer: a view of its DDP bucket rebuilt on the
        device as a wake rebuilds it (None when ``t`` is elsewhere)."""
        key = t.untyped_storage()._cdata
        for buffer in _buffers(self.model):
            data = buffer.param_data
            if data is None or data.dtype not in _HALF or data.untyped_storage()._cdata != key:
                continue
            index = t.storage_offset() - data.storage_offset()
            for bucket in buffer.buckets:
                if bucket.offset <= index < bucket.offset + bucket.param_data.numel():
                    flat = self._rebuilt_bucket(buffer, bucket)
                    return flat.as_strided(t.shape, t.stride(), index - bucket.offset)
        return None

    def _rebuilt_bucket(self, buffer, bucket) -> torch.Tensor:
        """One bucket's 16-bit values: each rank casts its fp32 master shards (read from the
        host) into its part, as ``_copy_main_params_to_model_params`` does, and the parts are
        all-gathered over the bucket's group, as ``start_param_sync`` does. The last bucket is
        kept (parameters are read bucket by bucket) until :meth:`drop_reads`."""
        if self._bucket is not None and self._bucket[0] is bucket:
            return self._bucket[1]
        self._bucket = None
        groups = self.model.bucket_groups + getattr(self.model, "expert_parallel_bucket_groups", [])
        group = next(g for g in groups if any(b is bucket for b in g.buckets))
        flat = torch.zeros(
            bucket.param_data.numel(), dtype=bucket.param_data.dtype, device=self.device
        )
        for opt in distributed_optimizers(self.optimizer):
            pairs = zip(opt.shard_fp32_from_float16_groups, opt.model_float16_groups)
            for mains, params in pairs:
                for main, param in zip(mains, params):
                    gbuf, _, bucket_id = opt.model_param_gbuf_map[param]
                    if opt.buffers[gbuf] is not buffer or bucket_id != bucket.bucket_id:
                        continue
                    world = opt._get_model_param_range_map(param)["gbuf_world_in_bucket"]
                    flat[world.start : world.end].copy_(self.read(main).view(-1))
        size = group.intra_distributed_optimizer_instance_size
        rank = group.intra_distributed_optimizer_instance_rank
        shard = flat.numel() // size
        mine = flat[rank * shard : (rank + 1) * shard].clone()
        torch.distributed.all_gather_into_tensor(
            flat, mine, group=group.intra_distributed_optimizer_instance_group
        )
        self._bucket = (bucket, flat)
        return flat

    def drop_reads(self) -> None:
        """Free what :meth:`read` keeps between calls (a rebuilt bucket); after a publish."""
        self._bucket = None

    def _rebuild_params(self) -> None:
        """16-bit parameter buffers <- cast of the fp32 master shards, all-gathered over DP."""
        for buffer in _buffers(self.model):
            if buffer.param_data is not None and buffer.param_data.dtype in _HALF:
                buffer.param_data.zero_()  # the padding between parameters, as DDP left it
        for opt in distributed_optimizers(self.optimizer):
            opt._copy_main_params_to_model_params()
        self.model.start_param_sync(force_sync=True)
        self._sync()

    # -- bookkeeping ------------------------------------------------------------------

    @property
    def host_bytes(self) -> int:
        """Host memory held for the sleeping state: the arena (cpu) or the ring (disk)."""
        if self._store is None:
            return 0
        if isinstance(self.store, DiskStore):
            return self.store.ring_bytes
        return self.store.nbytes

    @property
    def disk_path(self) -> str | None:
        return self._store.path if isinstance(self._store, DiskStore) else None

    def device_bytes(self) -> int:
        """Bytes currently held by the buffers', parameters' and optimizer tensors' storages
        (for tests)."""
        total, seen = 0, set()
        tensors = [b.param_data for b in _buffers(self.model)] + [
            b.grad_data for b in _buffers(self.model)
        ]
        params = list(self.model.parameters())
        for t in [*tensors, *params, *_optimizer_tensors(self.optimizer)]:
            if t is None:
                continue
            storage = t.untyped_storage()
            key = (storage.data_ptr(), id(storage))
            if storage.data_ptr() and key not in seen:
                seen.add(key)
                total += storage.size()
        return total

    def close(self) -> None:
        """Wake if asleep, then drop the host copy (and remove the disk file)."""
        self.wake_up()
        if self._store is not None:
            self._store.close()
            self._store = None


def _stage(key: str) -> str:
    """The stage of a key of :meth:`SleepWake._plan` (or a frozen parameter's)."""
    if key.startswith("optimizer"):
        return "optimizer state"
    if key.endswith("grad_data"):
        return "gradients"
    return "frozen parameters" if key.startswith("frozen") else "parameters"


def sleeper_from_args(
    model, optimizer, args, name: str = "megatron", role: str | None = None
) -> SleepWake:
    """``--offload-train-target`` / ``--offload-train-disk-*`` and
    ``--rematerialize-param-from-master-weight`` (validated by miles-core's offload group);
    ``name`` tags the disk file (the critic's differs from the actor's)."""
    target = OffloadTarget(
        kind=args.offload_train_target,
        disk_dir=args.offload_train_disk_dir,
        chunk_mb=args.offload_train_disk_chunk_mb,
    )
    remat = args.rematerialize_param_from_master_weight
    return SleepWake(model, optimizer, target, rematerialize=remat, name=name, role=role)
