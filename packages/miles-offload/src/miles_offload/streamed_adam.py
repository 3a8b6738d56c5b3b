"""AdamW whose fp32 master weights and both moments live in per-bucket files during the step.

``StreamedAdamW(named_params, lr, betas, eps, weight_decay, config=StreamedAdamConfig(...))``
(config: :mod:`miles_offload.streamed_adam_config`)
is a :class:`torch.optim.Optimizer` (``LambdaLR`` and ``param_groups`` work as usual). For
each parameter with at least ``min_numel`` elements (counted on the full parameter, so the
split does not depend on the DP size), this rank's local shard (``p.to_local()`` for FSDP2
DTensors) is laid out in buckets (:mod:`miles_offload.optimizer_buckets`), one file per
bucket in a fresh ``<disk_dir>/streamed-adam-<name>-rank<R>-<random>/``. ``step()`` runs::

    load bucket i+1 (file -> pinned ring -> device buffer)      thread "load"
    update bucket i on the device, copy the masters into the parameters
    store bucket i-1 (device buffer -> pinned ring -> file)     thread "store"

through :func:`miles_native.open_file_streamer` (O_DIRECT) and two
:class:`miles_native.CopyEngine`\\ s, so at most three bucket buffers exist on the device.
Smaller parameters keep an ordinary on-device AdamW state in ``self.state``.

Arithmetic: every update, streamed or not, is one call of torch's own functional
``torch.optim.adam.adam(..., decoupled_weight_decay=True)`` (:mod:`miles_offload.adamw_functional`) (what ``torch.optim.AdamW``
calls) with the same ``foreach`` / ``fused`` choice, on the master, gradient and moment
views of each segment. AdamW is elementwise, so with fp32 moments and fp32 parameters the
result is bit-identical to ``torch.optim.AdamW(foreach=..., fused=...)`` kept on the device:
``p <- p * (1 - lr * wd)``; ``m <- lerp(m, g, 1 - b1)``; ``v <- b2 * v + (1 - b2) * g * g``;
``p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)`` (single-tensor and
foreach order; the fused kernel has its own, matched by passing ``fused=True`` to both).
With ``moment_dtype="bf16"`` the moments are stored rounded to bf16 (round to nearest even)
and updated in fp32. Gradient clipping is the caller's, before ``step()``, as with AdamW.

The first ``step()`` initialises the masters from the parameters (so weights loaded after
the optimizer was built count). ``save(path)`` / ``load(path)`` write and read checkpoints
(:mod:`miles_offload.optimizer_manifest`); ``close()`` removes the working files.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from miles_core.args.parsed import ParsedArgs
from miles_native import CopyEngine, PinnedArena, open_file_streamer
from torch.distributed.tensor import DTensor

from miles_offload.adamw_functional import adamw_update, new_adamw_state, step_tensors
from miles_offload.disk_target import RAM_FILESYSTEMS, filesystem_type
from miles_offload.offload_target import default_disk_dir
from miles_offload.optimizer_buckets import (
    MOMENT_DTYPES,
    Bucket,
    Shard,
    entry_view,
    local_shard,
    plan_buckets,
)
from miles_offload.optimizer_manifest import load_checkpoint, save_checkpoint
from miles_offload.streamed_adam_config import StreamedAdamConfig

__all__ = ["StreamedAdamConfig", "StreamedAdamW", "from_args"]

logger = logging.getLogger(__name__)

SLOTS = 3  # device buffers: loading i+1, updating i, storing i-1
WORK_NUMEL = 1 << 25  # elements per update call: bounds fp32 working copies (bf16 moments/grads)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _close_all(streamers: list, directory: str) -> None:
    for s in streamers:
        if s.is_open:
            s.close(remove=True)
    shutil.rmtree(directory, ignore_errors=True)


class StreamedAdamW(torch.optim.Optimizer):
    """AdamW with its large-parameter state streamed from disk; see the module docstring."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        config: StreamedAdamConfig | None = None,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.config = config or StreamedAdamConfig()
        self.moment_dtype = MOMENT_DTYPES[self.config.moment_dtype]
        self.rank = _rank() if self.config.rank is None else self.config.rank
        self.world_size = _world() if self.config.world_size is None else self.config.world_size
        self._streamed: list[tuple[torch.Tensor, str, int]] = []  # (param, name, group index)
        self._small: list[tuple[torch.Tensor, str, int]] = []
        shards: list[Shard] = []
        for gi, group in enumerate(self.param_groups):
            names = group.get("param_names")
            if names is None:
                raise ValueError(
                    "StreamedAdamW needs named parameters: pass model.named_parameters()"
                )
            for p, name in zip(group["params"], names):
                if p.numel() >= self.config.min_numel and p.numel() > 0:
                    local, start = local_shard(p)
                    shards.append(
                        Shard(len(self._streamed), name, tuple(p.shape), start, local.numel())
                    )
                    self._streamed.append((p, name, gi))
                else:
                    self._small.append((p, name, gi))
        self._shards = shards
        # optimizer steps taken by each streamed parameter, like AdamW's state["step"]
        self._steps = [0] * len(self._streamed)
        itemsize = torch.empty((), dtype=self.moment_dtype).element_size()
        self.buckets: list[Bucket] = plan_buckets(shards, self.config.bucket_numel, itemsize)
        self._initialized = False  # bucket files hold state (after the first step or a load)
        self._failed: str | None = None
        devices = {local_shard(p)[0].device for p, _, _ in self._streamed}
        if len(devices) > 1:
            raise ValueError(f"StreamedAdamW: streamed parameters on several devices {devices}")
        self.device = devices.pop() if devices else torch.device("cpu")
        parent = self.config.disk_dir or default_disk_dir()
        os.makedirs(parent, exist_ok=True)
        self.directory = tempfile.mkdtemp(
            prefix=f"streamed-adam-{self.config.name}-rank{self.rank:05d}-", dir=parent
        )
        self._streamers = []
        if self.buckets:
            self._open_files()
        self._finalizer = weakref.finalize(self, _close_all, self._streamers, self.directory)
        self._io = [
            ThreadPoolExecutor(1, thread_name_prefix=f"streamed-adam-{k}")
            for k in ("load", "store")
        ]
        on_cuda = self.device.type == "cuda"
        index = (self.device.index or 0) if on_cuda else 0
        self._engines = [CopyEngine(device=index), CopyEngine(device=index)]
        self._side_streams = (
            [torch.cuda.Stream(self.device) for _ in range(SLOTS)] if on_cuda else []
        )

    def _open_files(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        fs = filesystem_type(self.directory)
        if fs in RAM_FILESYSTEMS:
            logger.warning("streamed optimizer state in %s is on %s (host RAM)", self.directory, fs)
        for bucket in self.buckets:
            self._streamers.append(
                open_file_streamer(
                    os.path.join(self.directory, bucket.file_name),
                    self.config.chunk_mb << 20,
                    ring_chunks=self.config.ring_chunks,
                    io_threads=self.config.io_threads,
                    direct=self.config.direct_io,
                )
            )

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None):
        if self._failed is not None:
            raise RuntimeError(
                f"StreamedAdamW: a previous step failed ({self._failed}); the state on disk is "
                "inconsistent. Resume from the last checkpoint"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step_small()
        if self.buckets:
            self._step_streamed()
        return loss

    def _adam(self, group: dict, params, grads, exp_avgs, exp_avg_sqs, steps) -> None:
        adamw_update(group, params, grads, exp_avgs, exp_avg_sqs, steps, self.config)

    def _step_tensors(self, counts: list[int], device: torch.device) -> list[torch.Tensor]:
        return step_tensors(counts, device, bool(self.config.fused))

    def new_small_state(self, p: torch.Tensor, step: int) -> dict[str, torch.Tensor]:
        """Zero moments and a step counter, as ``torch.optim.AdamW`` creates them."""
        return new_adamw_state(p, step, bool(self.config.fused))

    def _step_small(self) -> None:
        """Ordinary AdamW (state in ``self.state``) for the parameters below ``min_numel``."""
        for gi, group in enumerate(self.param_groups):
            items = [(p, n) for p, n, g in self._small if g == gi and p.grad is not None]
            if not items:
                continue
            params, grads, ms, vs, steps = [], [], [], [], []
            for p, _ in items:
                state = self.state[p]
                if not state:
                    state.update(self.new_small_state(p, 0))
                params.append(p)
                grads.append(p.grad)
                ms.append(state["exp_avg"])
                vs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            self._adam(group, params, grads, ms, vs, steps)

    def _step_streamed(self) -> None:
        nbytes = max(b.nbytes for b in self.buckets)
        slots = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(SLOTS)]
        loads: dict[int, Future] = {}
        stores: dict[int, Future] = {}
        n = len(self.buckets)

        def wait(futures: dict[int, Future], i: int) -> None:
            future = futures.pop(i, None)
            if future is not None:
                future.result()

        try:
            if self._initialized:
                loads[0] = self._io[0].submit(self._load, 0, slots[0])
            for i in range(n):
                if i + 1 < n:
                    wait(stores, i + 1 - SLOTS)  # its slot is free once bucket i-2 is on disk
                    if self._initialized:
                        loads[i + 1] = self._io[0].submit(self._load, i + 1, slots[(i + 1) % SLOTS])
                wait(loads, i)
                self._update(self.buckets[i], slots[i % SLOTS])
                stream = 0
                if self._side_streams:
                    side = self._side_streams[i % SLOTS]
                    side.wait_stream(torch.cuda.current_stream(self.device))
                    stream = side.cuda_stream
                stores[i] = self._io[1].submit(self._store, i, slots[i % SLOTS], stream)
            for i in sorted(stores):
                wait(stores, i)
        except BaseException as error:
            for future in (*loads.values(), *stores.values()):  # no copy may outlive the slots
                try:
                    future.result()
                except BaseException:
                    pass
            self._failed = str(error)
            if not isinstance(error, OSError):
                raise
            raise OSError(
                error.errno,
                f"streamed AdamW step {self._global_step() + 1} failed ({error}); the optimizer "
                "state files are now inconsistent: resume from the last checkpoint",
                error.filename,
            ) from error
        for k, (p, _, _) in enumerate(self._streamed):
            if p.grad is not None:
                self._steps[k] += 1
        self._initialized = True

    def _load(self, i: int, slot: torch.Tensor) -> None:
        bucket = self.buckets[i]
        self._streamers[i].load([slot.data_ptr()], [0], [bucket.nbytes], self._engines[0], 0)

    def _store(self, i: int, slot: torch.Tensor, after_stream: int) -> None:
        bucket = self.buckets[i]
        self._streamers[i].store(
            [slot.data_ptr()], [0], [bucket.nbytes], self._engines[1], after_stream
        )

    def _update(self, bucket: Bucket, buffer: torch.Tensor) -> None:
        """AdamW on one bucket's segments (grouped by param group), then masters -> params.

        Pieces go to the update in batches of at most ``WORK_NUMEL`` elements (AdamW is
        elementwise), which bounds the fp32 working copies of bf16 moments or gradients.
        """
        per_group: dict[int, list] = {}
        for seg in bucket.segments:
            p, _, gi = self._streamed[seg.index]
            local = _local(p).view(-1)[seg.start : seg.start + seg.numel]
            master = entry_view(buffer, seg, 0, self.moment_dtype)
            m = entry_view(buffer, seg, 1, self.moment_dtype)
            v = entry_view(buffer, seg, 2, self.moment_dtype)
            if not self._initialized:
                master.copy_(local)
                m.zero_()
                v.zero_()
            if p.grad is None:
                continue
            grad = _local(p.grad).view(-1)[seg.start : seg.start + seg.numel]
            per_group.setdefault(gi, []).append((seg, local, master, m, v, grad))
        for gi, items in per_group.items():
            group = self.param_groups[gi]
            batch, batch_numel = [], 0
            for item in items:
                seg = item[0]
                for a in range(0, seg.numel, WORK_NUMEL):
                    b = min(seg.numel, a + WORK_NUMEL)
                    batch.append((seg.index, *(t[a:b] for t in item[1:])))
                    batch_numel += b - a
                    if batch_numel >= WORK_NUMEL:
                        self._update_batch(group, batch)
                        batch, batch_numel = [], 0
            if batch:
                self._update_batch(group, batch)

    def _update_batch(self, group: dict, batch: list) -> None:
        fp32 = self.moment_dtype == torch.float32
        masters = [b[2] for b in batch]
        grads = [b[5] if b[5].dtype == torch.float32 else b[5].float() for b in batch]
        ms = [b[3] if fp32 else b[3].float() for b in batch]
        vs = [b[4] if fp32 else b[4].float() for b in batch]
        steps = self._step_tensors([self._steps[b[0]] for b in batch], self.device)
        self._adam(group, masters, grads, ms, vs, steps)
        for b, m32, v32 in zip(batch, ms, vs):
            if not fp32:
                b[3].copy_(m32)
                b[4].copy_(v32)
            b[1].copy_(b[2])  # the parameter takes the new master (cast to its dtype)

    def _global_step(self) -> int:
        return max(self._steps, default=0)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        raise RuntimeError(
            "StreamedAdamW keeps its state in files: checkpoint it with save(path) / load(path)"
        )

    def load_state_dict(self, state_dict: dict) -> None:
        self.state_dict()

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "buckets"):
            raise RuntimeError("StreamedAdamW: parameter groups are fixed at construction")
        super().add_param_group(param_group)

    @property
    def pinned_bytes(self) -> int:
        """Host memory pinned for staging: one ring per bucket file."""
        return sum(s.ring_bytes for s in self._streamers)

    @property
    def direct_io(self) -> bool:
        """Whether every bucket file bypasses the page cache (O_DIRECT accepted)."""
        return all(s.direct for s in self._streamers)

    def param_records(self) -> dict[str, dict]:
        """Every parameter as the manifest records it: shape, streamed, flat range, step."""
        records = {}
        for k, (p, name, _) in enumerate(self._streamed):
            shard = self._shards[k]
            records[name] = {
                "shape": list(p.shape),
                "streamed": True,
                "global_start": shard.global_start,
                "local_numel": shard.numel,
                "step": self._steps[k],
            }
        for p, name, _ in self._small:
            local, start = local_shard(p)
            state = self.state.get(p, {})
            records[name] = {
                "shape": list(p.shape),
                "streamed": False,
                "global_start": start,
                "local_numel": local.numel(),
                "step": int(state["step"].item()) if "step" in state else 0,
            }
        return records

    def save(self, path: str) -> None:
        """Copy this rank's bucket files and small-parameter state into ``path/rank<R>/``."""
        save_checkpoint(self, path)

    def load(self, path: str) -> None:
        """Resume from ``save(path)`` of any DP size or bucket size (re-bucketed by name)."""
        load_checkpoint(self, path)

    def read_state(self, name: str) -> dict[str, torch.Tensor]:
        """This rank's ``master`` / ``exp_avg`` / ``exp_avg_sq`` of streamed ``name``, flat, on CPU."""
        k = next(k for k, (_, n, _) in enumerate(self._streamed) if n == name)
        numel = self._shards[k].numel
        out = {
            "master": torch.empty(numel, dtype=torch.float32),
            "exp_avg": torch.empty(numel, dtype=self.moment_dtype),
            "exp_avg_sq": torch.empty(numel, dtype=self.moment_dtype),
        }
        for bucket in self.buckets:
            for seg in bucket.segments:
                if seg.index != k:
                    continue
                arena = PinnedArena(bucket.nbytes, pin=False)
                self._streamers[bucket.index].read(arena.ptr, bucket.nbytes, 0)
                buffer = torch.frombuffer(arena, dtype=torch.uint8)
                for kind, key in enumerate(out):
                    view = entry_view(buffer, seg, kind, self.moment_dtype)
                    out[key][seg.start : seg.start + seg.numel].copy_(view)
        return out

    def close(self) -> None:
        """Remove the working files; the optimizer is unusable afterwards."""
        for executor in self._io:
            executor.shutdown(wait=True)
        self._finalizer()


def from_args(params: Any, args: ParsedArgs, name: str = "actor") -> StreamedAdamW:
    """The streamed AdamW of a run: ``--lr``, ``--adam-beta1/2``, ``--adam-eps``,
    ``--weight-decay``, ``--offload-train-disk-dir`` and ``--stream-optimizer-*``.

    ``params``: ``model.named_parameters()`` (trainable ones). Like the FSDP backend's AdamW,
    the fused kernel runs when the parameters are on CUDA, ``foreach`` otherwise. The LR
    schedule (a ``LambdaLR`` over this optimizer) and gradient clipping stay the caller's.
    """
    params = [(n, p) for n, p in params if p.requires_grad]
    on_cuda = bool(params) and all(p.device.type == "cuda" for _, p in params)
    config = StreamedAdamConfig(
        disk_dir=args.offload_train_disk_dir,
        moment_dtype=args.stream_optimizer_state_moment_dtype,
        bucket_numel=args.stream_optimizer_bucket_numel,
        min_numel=args.stream_optimizer_min_numel,
        name=name,
        foreach=None if on_cuda else True,
        fused=True if on_cuda else None,
    )
    return StreamedAdamW(
        params,
        lr=args.lr,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps,
        weight_decay=args.weight_decay,
        config=config,
    )
