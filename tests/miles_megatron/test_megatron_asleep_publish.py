"""A sleeping Megatron trainer publishes without waking: 2 gloo ranks, one rollout trained,
``update_weights`` to a real built-in engine awake and then after ``sleep()``; the engine serves
the same bytes both times, the publish woke nothing (the sleeper's wake count is unchanged), the
model is still asleep afterwards and no model or optimizer storage holds device memory.

All under ``extended`` (the default suite has FSDP's, tests/miles_fsdp/test_asleep_publish.py):
the ``cpu`` target at TP=2 (each parameter read from the pinned arena), the ``disk`` target at
PP=2 (each stage reads its own layers asleep, rank 0 sends both), qwen3_moe at EP=2 with the
``cpu`` target (expert buffers read asleep, gathered over EP) and the rematerialised-masters
source at TP=2 (each DDP bucket rebuilt from the host fp32 masters)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "miles_sync"))

from colocated_testing import engine_checkpoint, with_engine  # noqa: E402
from dist_ranks import spawn_ranks  # noqa: E402
from megatron_tiny_models import make_tiny_hf  # noqa: E402

pytestmark = pytest.mark.slow


def publish_awake_then_asleep(
    rank: int, world: int, hf_dir: str, engine_url: str, flags: list[str], layout: dict
) -> dict:
    import httpx
    from backend_reference import samples
    from megatron_ranks import BOTH_BACKENDS_FLAGS, layout_argv, parse
    from miles_core.batch import RolloutBatch
    from miles_megatron.backend import MegatronBackend

    def served():
        return httpx.get(f"{engine_url}/weights_digest", timeout=60).json() if rank == 0 else None

    backend = MegatronBackend()
    argv = ["--hf-checkpoint", hf_dir, *BOTH_BACKENDS_FLAGS, *layout_argv(**layout)]
    backend.init(parse([*argv, "--offload-train", *flags]))
    backend.train(0, RolloutBatch(samples()))
    backend.update_weights([engine_url])
    out = {"awake": served()}
    backend.sleep()
    wakes = backend.sleeper.wakes
    backend.update_weights([engine_url])
    out["asleep"] = served()
    out["woke"] = backend.sleeper.wakes - wakes
    out["still_asleep"] = backend.sleeper.asleep
    out["device_bytes"] = backend.sleeper.device_bytes()
    backend.close()
    return out


def run(tmp_path: Path, target: str, layout: dict, family: str = "qwen3") -> list[dict]:
    hf_dir = make_tiny_hf(family, tmp_path / "hf")
    engine_dir = engine_checkpoint(hf_dir, tmp_path / "engine_ckpt")
    flags = ["--offload-train-target", target]
    if target == "disk":
        flags += ["--offload-train-disk-dir", str(tmp_path / "offload")]

    def publish(engine):
        args = (str(hf_dir), engine.url, flags, layout)
        return engine.digests(), spawn_ranks(publish_awake_then_asleep, 2, *args, timeout=500)

    before, results = with_engine(engine_dir, publish)
    awake = results[0]["awake"]
    assert awake != before  # the trained weights arrived
    assert results[0]["asleep"] == awake
    for r in results:
        assert r["woke"] == 0, "the publish woke the trainer"
        assert r["still_asleep"] and r["device_bytes"] == 0
    return results


@pytest.mark.extended
def test_asleep_publish_tp2_cpu(tmp_path):
    run(tmp_path, "cpu", {"tp": 2})


@pytest.mark.extended
@pytest.mark.parametrize(
    "target, layout, family",
    [
        ("disk", {"pp": 2}, "qwen3"),
        ("cpu", {"ep": 2}, "qwen3_moe"),
    ],
    ids=["disk-pp2", "cpu-ep2-moe"],  # with test_asleep_publish_tp2_cpu: both targets
)
def test_asleep_publish(tmp_path, target, layout, family):
    run(tmp_path, target, layout, family)


def remat_source_awake_then_asleep(rank: int, world: int, hf_dir: str, layout: dict) -> dict:
    """bf16 under ``--rematerialize-param-from-master-weight``: the publish source's tensors
    (every stage's, on every rank) awake and asleep, where each bucket is rebuilt from the
    fp32 masters on the host."""
    from backend_reference import samples
    from megatron_ranks import BOTH_BACKENDS_FLAGS, layout_argv, parse
    from miles_core.batch import RolloutBatch
    from miles_megatron.backend import MegatronBackend

    backend = MegatronBackend()
    flags = ["--bf16", "--colocate", "--rematerialize-param-from-master-weight"]
    argv = ["--hf-checkpoint", hf_dir, *BOTH_BACKENDS_FLAGS, *layout_argv(**layout), *flags]
    backend.init(parse(argv))
    backend.train(0, RolloutBatch(samples()))
    awake = [(n, t.clone()) for n, t in backend.publish_weights(to_all=True)]
    backend.sleep()
    wakes = backend.sleeper.wakes
    asleep = [(n, t.clone()) for n, t in backend.publish_weights(to_all=True)]
    backend.sleeper.drop_reads()
    out = {
        "names_equal": [n for n, _ in awake] == [n for n, _ in asleep],
        "dtypes": sorted({str(t.dtype) for _, t in awake}),
        "differ": [n for (n, a), (_, b) in zip(awake, asleep) if not torch.equal(a, b)],
        "woke": backend.sleeper.wakes - wakes,
        "still_asleep": backend.sleeper.asleep,
        "device_bytes": backend.sleeper.device_bytes(),
    }
    backend.close()
    return out


def check_remat(tmp_path: Path, layout: dict) -> None:
    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    for r in spawn_ranks(remat_source_awake_then_asleep, 2, hf_dir, layout, timeout=400):
        assert r["names_equal"] and r["dtypes"] == ["torch.bfloat16"], r
        assert r["differ"] == [], r
        assert r["woke"] == 0 and r["still_asleep"] and r["device_bytes"] == 0, r


@pytest.mark.extended
def test_remat_asleep_source_tp2(tmp_path):
    check_remat(tmp_path, {"tp": 2})
