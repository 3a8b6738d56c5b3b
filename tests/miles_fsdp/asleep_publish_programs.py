"""Rank programs of test_asleep_publish: publish awake, sleep, publish asleep, compare."""

from __future__ import annotations

import json

import torch
from miles_core.batch import RolloutBatch, Sample
from miles_fsdp.backend import FSDPBackend
from run_args import make_args
from spawn import gather_to_file
from torch.distributed.tensor import DTensor

VOCAB = 48  # the tiny model's vocabulary (tests/miles_sync/sync_testing.py)


def rollout(seed: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    samples = [
        Sample(
            tokens=torch.randint(1, VOCAB, (9,), generator=g),
            response_length=5,
            reward=float(i % 2),
            group_index=i // 2,
        )
        for i in range(4)
    ]
    return RolloutBatch(samples)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def optimizer_state_resident_bytes(backend: FSDPBackend) -> int:
    """Bytes of AdamW (and EMA) state whose storage is still on the device (on a CPU test
    machine the "device" is the host: what did not move to the target's arena or file)."""
    mover = backend.mover
    total = 0
    optimizers = [backend.optimizer] + ([backend.ema] if backend.ema is not None else [])
    for opt in optimizers:
        for state in opt.state.values():
            for value in state.values():
                if not isinstance(value, torch.Tensor) or value.numel() < 2:
                    continue
                local = _local(value)
                storage = local.untyped_storage()
                if storage.nbytes() == 0:  # disk: in the file
                    continue
                if any(
                    getattr(g.store, "owns", None) and g.store.owns(local) for g in mover._groups
                ):
                    continue  # cpu: in the pinned arena
                total += storage.nbytes()
    return total


def engine_digests(url: str) -> dict[str, list]:
    """The test engine's per-tensor digests of what it serves (``/weights_digest``)."""
    import httpx

    return httpx.get(f"{url}/weights_digest", timeout=60).json()


def publish_program(rank, world, hf_dir, engine_url, flags, out_file):
    """Train one rollout, publish awake (digests A), sleep, publish asleep (digests B)."""
    flags = json.loads(flags)
    weights = flags.pop("publish_weights", None)
    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=hf_dir, **flags))
    try:
        backend.train(0, rollout(0))
        backend.update_weights([engine_url], weights=weights)
        awake = engine_digests(engine_url) if rank == 0 else None
        backend.sleep()
        moved = backend.mover.last.bytes_copied
        backend.update_weights([engine_url], weights=weights)
        asleep = engine_digests(engine_url) if rank == 0 else None
        res = {
            "awake": awake,
            "asleep": asleep,
            "still_asleep": backend.asleep,
            "optimizer_on_device": optimizer_state_resident_bytes(backend),
            "moved_at_sleep": moved,
        }
        # and back: waking gives the same weights again
        backend.wake_up()
        backend.update_weights([engine_url], weights=weights)
        res["woken"] = engine_digests(engine_url) if rank == 0 else None
        gather_to_file(res, out_file)
    finally:
        backend.close()


def model_resident_bytes(backend: FSDPBackend) -> int:
    """Bytes of the actor's parameters and buffers still on the device (not in the arena or
    the file)."""
    mover, total = backend.mover, 0
    for t in [*backend.model.parameters(), *backend.model.buffers()]:
        local = _local(t.detach())
        storage = local.untyped_storage()
        if storage.nbytes() == 0:
            continue
        if mover is not None and any(
            getattr(g.store, "owns", None) and g.store.owns(local) for g in mover._groups
        ):
            continue
        total += local.numel() * local.element_size()
    return total


def residency(backend: FSDPBackend):
    """The FSDP trainer's :class:`colocated_testing.Residency`."""
    from colocated_testing import Residency

    return Residency(
        asleep=lambda: backend.asleep,
        model_on_device=lambda: model_resident_bytes(backend),
        optimizer_on_device=lambda: (
            optimizer_state_resident_bytes(backend) if backend.mover is not None else -1
        ),
        wakes=lambda: backend.mover.wakes if backend.mover is not None else 0,
    )


def cycle_program(rank, world, hf_dir, engine_url, flags, out_file):
    """The colocated cycle (:func:`colocated_testing.drive_cycle`) around the real backend."""
    from colocated_testing import drive_cycle

    flags = json.loads(flags)
    backend = FSDPBackend()
    args = make_args(hf_checkpoint=hf_dir, **flags)
    backend.init(args)
    try:
        train = lambda rollout_id: backend.train(rollout_id, rollout(rollout_id))  # noqa: E731
        drive_cycle(rank, world, backend, args, residency(backend), engine_url, train, out_file)
    finally:
        backend.close()
