"""``MegatronBackend.update_weights`` to SGLang's own receive code (the engine stand-in of
tests/sglang_conformance) in every transfer mode, from one gloo rank: after a training step,
what SGLang's code reconstructed equals the trainer's HF-named weights bit for bit. The
backend's own flags pick the mode; its publisher is re-made for each."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "sglang_conformance"))

from dist_ranks import spawn_ranks  # noqa: E402
from megatron_tiny_models import make_tiny_hf  # noqa: E402
from publishing import MODES, puller  # noqa: E402

pytestmark = pytest.mark.slow


def train_and_publish_in_every_mode(rank: int, world: int, hf_dir: str, url: str, shared: str):
    """One rollout, then one publish per mode; per mode, what the stand-in then holds."""
    import httpx
    from backend_reference import samples
    from megatron_ranks import BOTH_BACKENDS_FLAGS, layout_argv, parse
    from miles_core.batch import RolloutBatch
    from miles_megatron.backend import MegatronBackend
    from publishing import digests, mode_flags

    backend = MegatronBackend()
    backend.init(parse(["--hf-checkpoint", hf_dir, *BOTH_BACKENDS_FLAGS, *layout_argv(tp=1)]))
    backend.args.update_weight_buffer_size = 4096
    backend.train(0, RolloutBatch(samples()))
    want = digests(backend.hf_weights())
    served = {}
    for mode in MODES:
        for key, value in mode_flags(mode, Path(shared)).items():
            setattr(backend.args, key, value)
        if backend._publisher is not None:
            backend._publisher.close()
            backend._publisher = None
        httpx.post(f"{url}/reset_weights", json={}).raise_for_status()
        backend.update_weights([url])
        served[mode] = httpx.get(f"{url}/weights_digest").json()
    backend.close()
    return {"want": want, "served": served}


def test_megatron_publishes_to_sglang_in_every_mode(sglang_engine, tmp_path):
    hf_dir = make_tiny_hf("qwen3", tmp_path / "hf")
    shared = tmp_path / "shared"
    with puller(sglang_engine.url, shared, tmp_path / "local"):
        (result,) = spawn_ranks(
            train_and_publish_in_every_mode, 1, str(hf_dir), sglang_engine.url, str(shared)
        )
    want = result["want"]
    assert len(want) > 4
    for mode in MODES:
        assert result["served"][mode] == want, mode
