"""``--kl-coef`` (KL in the reward) on the megatron backend against the formulas in float64:
``r_t = -kl_coef * (log pi(y_t) - log pi_ref(y_t)) + R [t = n - 1]``, ``A_t = sum_{s >= t} r_s``
(reinforce_plus_plus, gamma 1), loss at ratio 1 ``(1/S) sum_i (1/n_i) sum_t -A_it``."""

from __future__ import annotations

import pytest
import torch
from dist_ranks import spawn_ranks
from megatron_ranks import kl_in_reward_loss
from megatron_tiny_models import make_tiny_hf

KL_COEF = 0.5


def response_log_probs(model, sample) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=sample.tokens[None]).logits[0]
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, sample.tokens[1:, None])[:, 0]
    return lp[-sample.response_length :]


def expected_loss(actor_dir, ref_dir) -> float:
    from backend_reference import samples
    from transformers import AutoModelForCausalLM

    actor = AutoModelForCausalLM.from_pretrained(actor_dir, dtype=torch.float64)
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float64)
    data = samples()
    total = 0.0
    for s in data:
        kl = response_log_probs(actor, s) - response_log_probs(ref, s)
        rewards = -KL_COEF * kl
        rewards[-1] += s.reward
        returns = rewards.flip(0).cumsum(0).flip(0)
        total += float(-returns.sum() / s.response_length)
    return total / len(data)


@pytest.mark.slow
def test_kl_coef_reward_matches_the_formula(tmp_path):
    actor = str(make_tiny_hf("qwen3", tmp_path / "actor", seed=0))
    ref = str(make_tiny_hf("qwen3", tmp_path / "ref", seed=1))
    (loss,) = spawn_ranks(kl_in_reward_loss, 1, actor, ref, KL_COEF, timeout=400)
    expected = expected_loss(actor, ref)
    assert abs(loss - expected) < 1e-5, (loss, expected)
    assert abs(expected - expected_loss(actor, actor)) > 1e-3  # the KL term matters here


def test_kl_coef_without_a_reference_is_an_argument_error():
    from megatron_ranks import parse
    from miles_core.args import ArgumentError

    with pytest.raises(ArgumentError, match="needs a reference"):
        parse(["--kl-coef", "0.1", "--advantage-estimator", "reinforce_plus_plus"])
