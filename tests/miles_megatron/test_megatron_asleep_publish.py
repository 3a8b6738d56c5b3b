"""A sleeping Megatron trainer publishes without waking: 2 gloo ranks at TP=2, one rollout
trained, ``update_weights`` to a real built-in engine awake and then after ``sleep()``; the
engine serves the same bytes both times, the model is still asleep afterwards and no model or
optimizer storage holds device memory (``--offload-train-target cpu`` and ``disk``).
``extended``: the cpu target and PP=2, which wake for the publish and sleep again (same
bytes, asleep afterwards)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "miles_sync"))

from dist_ranks import spawn_ranks  # noqa: E402
from megatron_tiny_models import make_tiny_hf  # noqa: E402
from sync_testing import Engine, save_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow


def publish_awake_then_asleep(
    rank: int, world: int, hf_dir: str, engine_url: str, flags: list[str], pp: int
) -> dict:
    import httpx
    from backend_reference import samples
    from megatron_ranks import BOTH_BACKENDS_FLAGS, layout_argv, parse
    from miles_core.batch import RolloutBatch
    from miles_megatron.backend import MegatronBackend

    def served():
        return httpx.get(f"{engine_url}/weights_digest", timeout=60).json() if rank == 0 else None

    backend = MegatronBackend()
    argv = ["--hf-checkpoint", hf_dir, *BOTH_BACKENDS_FLAGS, *layout_argv(tp=world // pp, pp=pp)]
    backend.init(parse([*argv, "--offload-train", *flags]))
    backend.train(0, RolloutBatch(samples()))
    backend.update_weights([engine_url])
    out = {"awake": served()}
    backend.sleep()
    backend.update_weights([engine_url])
    out["asleep"] = served()
    out["still_asleep"] = backend.sleeper.asleep
    out["device_bytes"] = backend.sleeper.device_bytes()
    backend.close()
    return out


def run(tmp_path: Path, flags: list[str], pp: int = 1) -> list[dict]:
    hf_dir = make_tiny_hf("qwen3", tmp_path / "hf")
    engine_dir = tmp_path / "engine_ckpt"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).save_pretrained(engine_dir)
    save_tokenizer(engine_dir)
    engine = Engine(engine_dir, timeout=300)  # a loaded machine starts it slowly
    try:
        before = engine.digests()
        results = spawn_ranks(
            publish_awake_then_asleep, 2, str(hf_dir), engine.url, flags, pp, timeout=500
        )
    finally:
        engine.close()
    awake = results[0]["awake"]
    assert awake != before  # the trained weights arrived
    assert results[0]["asleep"] == awake
    for r in results:
        assert r["still_asleep"] and r["device_bytes"] == 0
    return results


def test_asleep_publish_tp2_disk(tmp_path):
    run(tmp_path, ["--offload-train-target", "disk", "--offload-train-disk-dir", str(tmp_path)])


@pytest.mark.extended
@pytest.mark.parametrize(
    "flags, pp",
    [
        (["--offload-train-target", "cpu"], 1),
        (["--offload-train-target", "cpu"], 2),
    ],
    ids=["cpu", "cpu-pp2"],
)
def test_asleep_publish(tmp_path, flags, pp):
    run(tmp_path, flags, pp)
