"""The colocated rollout cycle's residency (``miles_launch.loop.ColocatedCycle``, the steps the
synchronous loop takes): 2 gloo FSDP ranks and a real built-in engine, ``--offload-train`` and
``--offload-rollout``, two rollouts after the first publish. At every step the test records
where the actor's parameters, the optimizer state and the engine's weights and KV cache are,
and asserts the order generate -> engines release everything -> trainer wakes -> train ->
trainer sleeps -> engines resume weights only -> publish (trainer asleep, its model and
optimizer state on the host, never woken) -> engines resume KV cache and graphs; one wake and
one sleep of the trainer per rollout. ``disk`` here, ``cpu`` extended."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from asleep_publish_programs import cycle_program
from spawn import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "miles_sync"))

from sync_testing import Engine, save_checkpoint, tiny_model  # noqa: E402

pytestmark = pytest.mark.slow

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


def run(tmp_path: Path, target: str) -> list[list[dict]]:
    checkpoint = save_checkpoint(tiny_model(0), tmp_path / "ckpt")
    engine = Engine(checkpoint, timeout=300)  # a loaded machine starts it slowly
    flags = {
        "lr": 1e-2,
        "advantage_estimator": "grpo",
        "update_weight_buffer_size": 4096,
        "offload_train": True,
        "offload_rollout": True,
        "offload_train_target": target,
        "offload_train_disk_dir": str(tmp_path / "offload") if target == "disk" else None,
    }
    out = tmp_path / "log.json"
    try:
        args = (str(checkpoint), engine.url, json.dumps(flags), str(out))
        run_ranks(2, cycle_program, *args, timeout=400)
    finally:
        engine.close()
    return json.loads(out.read_text())


def check(logs: list[list[dict]]) -> None:
    for rank, log in enumerate(logs):
        steps = [(e["step"], e.get("tags")) for e in log]
        assert steps == FIRST + ROLLOUT + ROLLOUT, (rank, steps)
        at = {i: e for i, e in enumerate(log)}
        for i, e in at.items():
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
        assert sum(e["step"] == "trainer.wake_up" and e["moved"] for e in log) == 2
        assert sum(e["step"] == "trainer.sleep" and e["moved"] for e in log) == 3
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


def test_colocated_cycle_residency_disk(tmp_path):
    check(run(tmp_path, "disk"))


@pytest.mark.extended
def test_colocated_cycle_residency_cpu(tmp_path):
    check(run(tmp_path, "cpu"))
