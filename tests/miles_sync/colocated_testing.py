"""Test support shared by the asleep-publish and colocated-cycle tests of both backends.

* :func:`with_engine`: a real built-in engine (with ``/weights_digest`` and ``/memory_state``)
  on a checkpoint for the duration of one multi-rank run; :func:`engine_checkpoint`: the bf16
  checkpoint it serves for a Megatron test.
* :class:`Recorder` and :func:`drive_cycle`: the colocated rollout cycle
  (:class:`miles_launch.loop.ColocatedCycle`'s own steps) around a real backend and the real
  engine; every step records where the trainer's model and optimizer state and the engine's
  weights and KV cache are. The backend-specific part is a :class:`Residency` probe.
* :func:`check_cycle`: the order and residency every backend's cycle must show.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from sync_testing import Engine, save_tokenizer

T = TypeVar("T")

ROLLOUT = [
    ("generated", None),
    ("engines.release", ["weights", "kv_cache", "cuda_graph"]),
    ("trainer.wake_up", None),
    ("trained", None),
    ("trainer.sleep", None),
    ("engines.resume", ["weights"]),
    ("publish.start", None),
    ("publish.end", None),
    ("engines.resume", ["kv_cache", "cuda_graph"]),
]
FIRST = [
    ("engines.release", ["kv_cache", "cuda_graph"]),
    ("trainer.sleep", None),
    ("publish.start", None),
    ("publish.end", None),
    ("engines.resume", ["kv_cache", "cuda_graph"]),
]
ROLLOUTS = 2


def with_engine(checkpoint: Path, run: Callable[[Engine], T]) -> T:
    """``run(engine)`` with a built-in engine serving ``checkpoint``, closed afterwards."""
    engine = Engine(checkpoint, timeout=300)  # a loaded machine starts it slowly
    try:
        return run(engine)
    finally:
        engine.close()


def engine_checkpoint(hf_dir: Path, out: Path) -> Path:
    """``hf_dir``'s model in bf16 with the test tokenizer: what the engine of a Megatron test
    serves."""
    import torch
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).save_pretrained(out)
    save_tokenizer(out)
    return out


@dataclass
class Residency:
    """What a backend's trainer holds where: ``asleep()``; ``model_on_device()`` and
    ``optimizer_on_device()``, the bytes still on the device (-1: no optimizer state that
    moves); ``wakes()``, how many wake-ups have moved the state back so far."""

    asleep: Callable[[], bool]
    model_on_device: Callable[[], int]
    optimizer_on_device: Callable[[], int]
    wakes: Callable[[], int]


class Recorder:
    """The trainer and engines :class:`~miles_launch.loop.ColocatedCycle` drives: every call
    goes to the real backend and the real engine (rank 0 talks to the engine), and each step
    appends what is where."""

    def __init__(self, rank: int, backend, residency: Residency, engine_url: str) -> None:
        from miles_core.engine import EngineClient

        self.rank, self.backend, self.where, self.url = rank, backend, residency, engine_url
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
                "asleep": self.where.asleep(),
                "model_on_device": self.where.model_on_device(),
                "optimizer_on_device": self.where.optimizer_on_device(),
                "engine": engine,
                **extra,
            }
        )

    # the trainer the cycle sleeps and wakes
    def sleep(self) -> None:
        was = self.where.asleep()
        self.backend.sleep()
        self.snapshot("trainer.sleep", moved=not was and self.where.asleep())

    def wake_up(self) -> None:
        was = self.where.asleep()
        self.backend.wake_up()
        self.snapshot("trainer.wake_up", moved=was and not self.where.asleep())

    # the engines the cycle releases and resumes
    def _barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def release_memory(self, tags) -> None:
        if self.rank == 0:
            self.client.release_memory_occupation(list(tags))
        self._barrier()
        self.snapshot("engines.release", tags=list(tags))

    def resume_memory(self, tags) -> None:
        if self.rank == 0:
            self.client.resume_memory_occupation(list(tags))
        self._barrier()
        self.snapshot("engines.resume", tags=list(tags))

    def publish(self) -> None:
        self.snapshot("publish.start")
        before = self.where.wakes()
        self.backend.update_weights([self.url])
        self.snapshot("publish.end", woke=self.where.wakes() != before)


def drive_cycle(
    rank: int,
    world: int,
    backend,
    args,
    residency: Residency,
    engine_url: str,
    train: Callable[[int], Any],
    out_file: str,
) -> None:
    """The first publish and :data:`ROLLOUTS` rollouts of the colocated cycle; every rank's
    step log to ``out_file`` (JSON, written by rank 0). ``train(rollout_id)`` trains one."""
    import torch.distributed as dist
    from miles_launch.loop import ColocatedCycle

    rec = Recorder(rank, backend, residency, engine_url)
    cycle = ColocatedCycle(args, [rec], rec)
    cycle.first_publish(rec.publish)
    for rollout_id in range(ROLLOUTS):
        if rank == 0:  # generation fills the engine's KV cache
            params = {"max_new_tokens": 3, "temperature": 0}
            rec.client.generate(input_ids=[1, 2, 3], sampling_params=params)
        dist.barrier()
        rec.snapshot("generated")

        def train_one(rollout_id=rollout_id):
            metrics = train(rollout_id)
            rec.snapshot("trained")
            return metrics

        cycle.after_generation(train_one, lambda: False, rec.publish)
    gathered = [None] * world
    dist.all_gather_object(gathered, rec.log)
    if rank == 0:
        Path(out_file).write_text(json.dumps(gathered))


def check_cycle(logs: list[list[dict]]) -> None:
    """The cycle's order; the trainer asleep with its model and optimizer state off the device
    during every publish, never woken by it; one wake and one sleep per rollout; the engine's
    weights and KV cache released and resumed around them."""
    for rank, log in enumerate(logs):
        steps = [(e["step"], e.get("tags")) for e in log]
        assert steps == FIRST + ROLLOUT * ROLLOUTS, (rank, steps)
        for i, e in enumerate(log):
            if e["step"] in ("publish.start", "publish.end"):
                assert e["asleep"] and e["model_on_device"] == 0, (rank, i, e)
                assert e["optimizer_on_device"] in (0, -1), (rank, i, e)
                assert not e.get("woke"), (rank, i, e)
            if e["step"] == "trained":
                assert not e["asleep"] and e["model_on_device"] > 0
                assert e["optimizer_on_device"] > 0
            if e["step"] in ("trainer.sleep", "trainer.wake_up") and i >= len(FIRST):
                assert e["moved"], (rank, i, e)  # a real transition, once per rollout
        # one wake and one sleep per rollout (the first publish's sleep puts it to sleep)
        assert sum(e["step"] == "trainer.wake_up" and e["moved"] for e in log) == ROLLOUTS
        assert sum(e["step"] == "trainer.sleep" and e["moved"] for e in log) == ROLLOUTS + 1
    engine = [e["engine"] for e in logs[0]]
    steps = [e["step"] for e in logs[0]]
    for i, step in enumerate(steps):
        state = engine[i]
        if step == "generated":
            assert not state["weights_released"]
        if step in ("trainer.wake_up", "trained", "trainer.sleep") and i >= len(FIRST):
            assert state["weights_released"] and state["kv_cache_bytes"] == 0, (i, step)
        if step in ("publish.start", "publish.end"):
            assert not state["weights_released"] and state["kv_cache_bytes"] == 0, (i, step)
