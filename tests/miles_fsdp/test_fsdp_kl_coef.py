"""``--kl-coef`` (KL in the reward) on the FSDP backend against the formulas in float64:
``r_t = -kl_coef * (log pi(y_t) - log pi_ref(y_t)) + R [t = n - 1]``, ``A_t = sum_{s >= t} r_s``
(reinforce_plus_plus, gamma 1); with one step per rollout the ratio is 1, so the loss is
``(1/S) sum_i (1/n_i) sum_t -A_it``."""

from __future__ import annotations

import pytest
import torch
from dense_reference import dense_model, response_log_probs
from miles_fsdp.backend import FSDPBackend
from run_args import make_args
from samples import make_samples
from tiny_models import save_tiny_model

pytestmark = pytest.mark.slow
KL_COEF = 0.5


def expected_loss(actor_dir, ref_dir, samples) -> float:
    actor, ref = dense_model(actor_dir), dense_model(ref_dir)
    total = 0.0
    for s in samples:
        with torch.no_grad():
            rewards = -KL_COEF * (response_log_probs(actor, s) - response_log_probs(ref, s))
        rewards[-1] += s.reward
        returns = rewards.flip(0).cumsum(0).flip(0)
        total += float(-returns.sum() / s.response_length)
    return total / len(samples)


def test_kl_coef_reward_matches_the_formula(one_rank_group, tmp_path):
    from miles_core.batch import RolloutBatch

    actor = str(save_tiny_model(tmp_path / "actor", seed=0))
    ref = str(save_tiny_model(tmp_path / "ref", seed=1))
    samples = make_samples()
    backend = FSDPBackend()
    backend.init(
        make_args(
            hf_checkpoint=actor,
            ref_load=ref,
            ref_mode="ref",
            kl_coef=KL_COEF,
            advantage_estimator="reinforce_plus_plus",
            micro_batch_size=2,
        )
    )
    loss = backend.train(0, RolloutBatch(samples))["loss"]
    backend.close()
    expected = expected_loss(actor, ref, samples)
    assert abs(loss - expected) < 1e-5, (loss, expected)
    assert abs(expected - expected_loss(actor, actor, samples)) > 1e-3  # the KL term matters
