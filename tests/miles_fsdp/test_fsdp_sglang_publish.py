"""``FSDPBackend.update_weights`` to SGLang's own receive code (the engine stand-in of
tests/sglang_conformance, one gloo rank) in every transfer mode: after a training step, what
SGLang's code reconstructed equals the trainer's weights cast to the checkpoint dtype, bit for
bit. The backend's own flags pick the mode; its publisher is re-made for each."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from miles_fsdp.backend import FSDPBackend
from rank_programs import full_params
from run_args import make_args
from test_ema_publish import digests, rollout

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "miles_sync"))
sys.path.insert(0, str(TESTS / "sglang_conformance"))

from publishing import MODES, mode_flags, puller  # noqa: E402
from sync_testing import save_checkpoint, tiny_model  # noqa: E402

pytestmark = pytest.mark.slow


def test_fsdp_publishes_to_sglang_in_every_mode(one_rank_group, sglang_engine, tmp_path):
    checkpoint = save_checkpoint(tiny_model(0), tmp_path / "ckpt")
    backend = FSDPBackend()
    backend.init(
        make_args(
            hf_checkpoint=str(checkpoint),
            lr=1e-2,
            advantage_estimator="grpo",
            update_weight_buffer_size=2048,  # smaller than the embedding (3 KiB in bf16)
        )
    )
    try:
        backend.train(0, rollout(0))
        want = digests(full_params(backend.model))
        with puller(sglang_engine.url, tmp_path / "shared", tmp_path / "local"):
            for mode in MODES:
                for key, value in mode_flags(mode, tmp_path / "shared").items():
                    setattr(backend.args, key, value)
                if backend.publisher is not None:
                    backend.publisher.close()
                    backend.publisher = None
                sglang_engine.reset()
                backend.update_weights([sglang_engine.url])
                served = sglang_engine.digests()
                assert {name: served.get(name) for name in want} == want, mode
                assert sglang_engine.version() == str(backend.publisher.version)
    finally:
        backend.close()
