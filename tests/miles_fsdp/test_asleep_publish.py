"""A sleeping FSDP trainer publishes without waking (``update_weights`` after ``sleep``), and
the engine receives the same bytes as from the awake trainer: 2 gloo ranks, a real built-in
engine with a weight-digest endpoint, ``--offload-train-target cpu`` and ``disk``; the actor,
the EMA (``weights="ema"``) and a LoRA actor (merged on the fly). The trainer is still asleep
afterwards and its optimizer state never left the target."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from asleep_publish_programs import publish_program
from spawn import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "miles_sync"))

from colocated_testing import with_engine  # noqa: E402
from sync_testing import save_checkpoint, tiny_model  # noqa: E402

pytestmark = pytest.mark.slow

CASES = {
    "actor": {},
    "ema": {
        "use_ema": True,
        "eval_weights": "ema",
        "ema_decay_init": 0.5,
        "publish_weights": "ema",
    },
    "lora": {
        "use_lora": True,
        "lora_rank": 4,
        "lora_alpha": 8.0,
        "lora_target_modules": ["q_proj", "v_proj", "down_proj"],
    },
}


def run(tmp_path: Path, target: str, case: str) -> list[dict]:
    checkpoint = save_checkpoint(tiny_model(0), tmp_path / "ckpt")
    flags = {
        "lr": 1e-2,
        "advantage_estimator": "grpo",
        "update_weight_buffer_size": 4096,  # many buckets and gather groups
        "offload_train": True,
        "offload_train_target": target,
        "offload_train_disk_dir": str(tmp_path / "offload") if target == "disk" else None,
        **CASES[case],
    }
    out = tmp_path / "out.json"
    with_engine(
        checkpoint,
        lambda engine: run_ranks(
            2,
            publish_program,
            str(checkpoint),
            engine.url,
            json.dumps(flags),
            str(out),
            timeout=300,
        ),
    )
    return json.loads(out.read_text())


def check(results: list[dict]) -> None:
    rank0 = results[0]
    assert rank0["awake"] and rank0["asleep"] == rank0["awake"]
    assert rank0["woken"] == rank0["awake"]
    for r in results:
        assert r["still_asleep"], "update_weights woke the trainer"
        assert r["optimizer_on_device"] == 0
        assert r["moved_at_sleep"] > 0


def test_asleep_publish_equals_awake_actor_disk(tmp_path):
    check(run(tmp_path, "disk", "actor"))


@pytest.mark.extended
@pytest.mark.parametrize(
    "target, case",
    [("cpu", "ema"), ("disk", "lora")],  # the default suite runs (disk, actor)
)
def test_asleep_publish_equals_awake(tmp_path, target, case):
    check(run(tmp_path, target, case))
