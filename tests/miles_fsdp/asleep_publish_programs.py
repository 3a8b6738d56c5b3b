"""Rank programs of test_asleep_publish: publish awake, sleep, publish asleep, compare."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from miles_core.batch import RolloutBatch, Sample
from miles_fsdp.backend import FSDPBackend
from run_args import make_args
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
        gathered = [None] * world
        dist.all_gather_object(gathered, res)
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(gathered, f)
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


class Recorder:
    """Observes the cycle that :class:`miles_launch.loop.ColocatedCycle` drives: the trainer
    and engines it is given forward every call to the real backend and the real engine (rank 0
    talks to the engine), and each step appends what is where."""

    def __init__(self, rank: int, backend: FSDPBackend, engine_url: str) -> None:
        from miles_core.engine import EngineClient

        self.rank, self.backend, self.url = rank, backend, engine_url
        self.client = EngineClient(engine_url)
        self.log: list[dict] = []

    def snapshot(self, step: str, **extra) -> None:
        import httpx

        engine = None
        if self.rank == 0:
            engine = httpx.get(f"{self.url}/memory_state", timeout=60).json()
        self.log.append(
            {
                "step": step,
                "asleep": self.backend.asleep,
                "model_on_device": model_resident_bytes(self.backend),
                "optimizer_on_device": optimizer_state_resident_bytes(self.backend)
                if self.backend.mover is not None
                else -1,
                "engine": engine,
                **extra,
            }
        )

    # the trainer the cycle sleeps and wakes
    def sleep(self) -> None:
        was = self.backend.asleep
        self.backend.sleep()
        self.snapshot("trainer.sleep", moved=not was and self.backend.asleep)

    def wake_up(self) -> None:
        was = self.backend.asleep
        self.backend.wake_up()
        self.snapshot("trainer.wake_up", moved=was and not self.backend.asleep)

    # the engines the cycle releases and resumes
    def release_memory(self, tags) -> None:
        if self.rank == 0:
            self.client.release_memory_occupation(list(tags))
        dist.barrier()
        self.snapshot("engines.release", tags=list(tags))

    def resume_memory(self, tags) -> None:
        if self.rank == 0:
            self.client.resume_memory_occupation(list(tags))
        dist.barrier()
        self.snapshot("engines.resume", tags=list(tags))

    def publish(self) -> None:
        self.snapshot("publish.start")
        last = self.backend.mover.last if self.backend.mover is not None else None
        self.backend.update_weights([self.url])
        woke = self.backend.mover is not None and self.backend.mover.last is not last
        self.snapshot("publish.end", woke=woke)


def cycle_program(rank, world, hf_dir, engine_url, flags, out_file):
    """Two rollouts of the colocated cycle (:class:`miles_launch.loop.ColocatedCycle`'s own
    steps) around the real backend and engine; every rank's step log to ``out_file``."""
    from miles_launch.loop import ColocatedCycle

    flags = json.loads(flags)
    backend = FSDPBackend()
    args = make_args(hf_checkpoint=hf_dir, **flags)
    backend.init(args)
    rec = Recorder(rank, backend, engine_url)
    try:
        cycle = ColocatedCycle(args, [rec], rec)
        cycle.first_publish(rec.publish)
        for rollout_id in range(2):
            if rank == 0:  # generation fills the engine's KV cache
                params = {"max_new_tokens": 3, "temperature": 0}
                rec.client.generate(input_ids=[1, 2, 3], sampling_params=params)
            dist.barrier()
            rec.snapshot("generated")

            def train(rollout_id=rollout_id):
                metrics = backend.train(rollout_id, rollout(rollout_id))
                rec.snapshot("trained")
                return metrics

            cycle.after_generation(train, lambda: False, rec.publish)
        gathered = [None] * world
        dist.all_gather_object(gathered, rec.log)
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(gathered, f)
    finally:
        backend.close()
