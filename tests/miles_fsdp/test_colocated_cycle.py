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

from colocated_testing import check_cycle, with_engine  # noqa: E402
from sync_testing import save_checkpoint, tiny_model  # noqa: E402

pytestmark = pytest.mark.slow


def run(tmp_path: Path, target: str) -> list[list[dict]]:
    checkpoint = save_checkpoint(tiny_model(0), tmp_path / "ckpt")
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
    with_engine(
        checkpoint,
        lambda engine: run_ranks(
            2, cycle_program, str(checkpoint), engine.url, json.dumps(flags), str(out), timeout=400
        ),
    )
    return json.loads(out.read_text())


def test_colocated_cycle_residency_disk(tmp_path):
    check_cycle(run(tmp_path, "disk"))


@pytest.mark.extended
def test_colocated_cycle_residency_cpu(tmp_path):
    check_cycle(run(tmp_path, "cpu"))
