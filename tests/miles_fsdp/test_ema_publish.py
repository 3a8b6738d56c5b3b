"""``FSDPBackend.update_weights(engines, weights=...)`` against a real built-in engine (a
subprocess with a weight-digest endpoint; one gloo trainer rank, broadcast transfer):
``weights="ema"`` makes the engine serve the EMA, cast to the checkpoint dtype, bit for bit
(what an engine-side evaluation under ``--eval-weights ema`` reads); the default
(``--rollout-weights actor``) serves the training weights again. Neither publish changes the
actor or the EMA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import xxhash
from miles_core.batch import RolloutBatch, Sample
from miles_fsdp.backend import FSDPBackend
from rank_programs import full_params
from role_programs import full_ema
from run_args import make_args

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "miles_sync"))

from sync_testing import CHECKPOINT_DTYPE, VOCAB, Engine, save_checkpoint, tiny_model  # noqa: E402

pytestmark = pytest.mark.slow


def digests(named: dict[str, torch.Tensor]) -> dict[str, list]:
    """What the engine reports for weights ``named`` cast to the checkpoint dtype."""
    out = {}
    for name, tensor in named.items():
        cast = tensor.detach().to(CHECKPOINT_DTYPE).contiguous()
        raw = cast.view(-1).view(torch.uint8).numpy()
        out[name] = [xxhash.xxh3_128_hexdigest(raw), str(cast.dtype), list(cast.shape)]
    return out


def rollout(seed: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    return RolloutBatch(
        [
            Sample(
                tokens=torch.randint(1, VOCAB, (9,), generator=g),
                response_length=5,
                reward=float(i % 2),
                group_index=i // 2,
            )
            for i in range(4)
        ]
    )


def test_publish_ema_then_training_weights(one_rank_group, tmp_path):
    checkpoint = save_checkpoint(tiny_model(0), tmp_path / "ckpt")
    engine = Engine(checkpoint)
    backend = FSDPBackend()
    try:
        backend.init(
            make_args(
                hf_checkpoint=str(checkpoint),
                use_ema=True,
                eval_weights="ema",
                ema_decay_init=0.5,
                lr=1e-2,
                advantage_estimator="grpo",
                update_weight_buffer_size=4096,
            )
        )
        for rollout_id in range(2):
            backend.train(rollout_id, rollout(rollout_id))
        actor, ema = full_params(backend.model), full_ema(backend)
        assert digests(ema) != digests(actor)  # the engine can tell them apart
        updates = backend.ema.param_groups[0]["updates"]

        backend.update_weights([engine.url], weights="ema")
        served = engine.digests()
        assert {name: served[name] for name in ema} == digests(ema)

        backend.update_weights([engine.url])  # --rollout-weights actor
        served = engine.digests()
        assert {name: served[name] for name in actor} == digests(actor)

        for name, value in full_params(backend.model).items():
            assert torch.equal(value, actor[name]), name
        for name, value in full_ema(backend).items():
            assert torch.equal(value, ema[name]), name
        assert backend.ema.param_groups[0]["updates"] == updates
        with pytest.raises(ValueError, match="weights must be 'actor' or 'ema', got 'best'"):
            backend.update_weights([engine.url], weights="best")
    finally:
        backend.close()
        engine.close()
