"""The critic role and ``--loss-type`` on the FSDP backend, against float64 references written
here: the critic's values (the HF model with a value head), GAE advantages and returns, and the
gradient of each loss type (``policy_loss``, ``sft_loss``, the critic's ``value_loss``)."""

from __future__ import annotations

import pytest
import torch
from critic_reference import attach_value_head
from dense_reference import dense_model, response_log_probs
from full_tensors import full
from miles_core.batch import RolloutBatch
from miles_fsdp.backend import FSDPBackend
from rank_programs import full_grads, full_params
from run_args import make_args
from samples import make_samples
from tiny_models import save_tiny_model
from tolerances import assert_within, grad_atol

pytestmark = [pytest.mark.slow, pytest.mark.numeric]
GAMMA, LAMBD, SEED = 0.9, 0.8, 3
PPO = dict(advantage_estimator="ppo", use_critic=True, gamma=GAMMA, lambd=LAMBD, seed=SEED)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("qwen3")))


def reference_critic(hf_dir) -> torch.nn.Module:
    """float64: the HF model, its LM head replaced by Linear(hidden, 1) with weights
    ``0.02 * randn(generator seeded with --seed)`` and bias 0 (the documented initialisation)."""
    return attach_value_head(dense_model(hf_dir), SEED)


def reference_values(model, sample) -> torch.Tensor:
    """``V_t`` of each response token: the head on the hidden state that predicts it."""
    out = model(input_ids=sample.tokens[None], use_cache=False).logits[0, :-1, 0]
    return out[-sample.response_length :]


def gae(rewards: list[float], values: list[float]) -> tuple[list[float], list[float]]:
    """float64 GAE: delta_t = r_t + gamma V_{t+1} - V_t (V_n = 0), A_t = delta_t + gamma lambd
    A_{t+1}; returns A and A + V."""
    n = len(rewards)
    adv = [0.0] * n
    running = 0.0
    for t in reversed(range(n)):
        next_v = values[t + 1] if t + 1 < n else 0.0
        running = rewards[t] + GAMMA * next_v - values[t] + GAMMA * LAMBD * running
        adv[t] = running
    return adv, [a + v for a, v in zip(adv, values)]


def critic(hf_dir, **flags) -> FSDPBackend:
    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=hf_dir, **(PPO | flags)), "critic")
    return backend


def test_critic_values_and_gae_match_float64(one_rank_group, hf_dir):
    from miles_core.advantages import with_advantages

    samples = make_samples()
    backend = critic(hf_dir, micro_batch_size=2)
    values = backend.compute_values(RolloutBatch(samples))
    backend.close()
    ref = reference_critic(hf_dir)
    batch = RolloutBatch(samples).with_fields(values=values)
    out = with_advantages(batch, make_args(hf_checkpoint=hf_dir, **PPO), None)
    for i, s in enumerate(samples):
        with torch.no_grad():
            expected = reference_values(ref, s)
        assert values[i].shape == (s.response_length,)
        torch.testing.assert_close(values[i].double(), expected, atol=1e-5, rtol=0)
        assert float(expected.abs().max()) > 1e-3  # the head is not zero
        rewards = [0.0] * (s.response_length - 1) + [s.reward]
        adv, ret = gae(rewards, values[i].double().tolist())
        torch.testing.assert_close(
            out[i].fields["advantages"].double(), torch.tensor(adv, dtype=torch.float64),
            atol=1e-6, rtol=0,
        )  # fmt: skip
        torch.testing.assert_close(
            out[i].fields["returns"].double(), torch.tensor(ret, dtype=torch.float64),
            atol=1e-6, rtol=0,
        )  # fmt: skip


def test_critic_from_another_hf_checkpoint(one_rank_group, hf_dir, tmp_path):
    """--critic-hf-checkpoint: the critic is that model (another width, same vocabulary) with
    the seeded value head, against float64; the actor's checkpoint plays no part."""
    from tiny_models import qwen3_config

    other = str(save_tiny_model(tmp_path / "wider", qwen3_config(hidden_size=48), seed=9))
    samples = make_samples(n=2)
    backend = critic(hf_dir, critic_hf_checkpoint=other, micro_batch_size=2)
    values = backend.compute_values(RolloutBatch(samples))
    backend.close()
    ref = reference_critic(other)
    assert ref.config.hidden_size == 48
    for i, s in enumerate(samples):
        with torch.no_grad():
            expected = reference_values(ref, s)
        torch.testing.assert_close(values[i].double(), expected, atol=1e-5, rtol=0)
        assert float(expected.abs().max()) > 1e-3


def seq_mean(per_sample: list[torch.Tensor]) -> torch.Tensor:
    """(1/S) sum_i (1/n_i) sum_t x_it (the default sequence-mean aggregation)."""
    return sum(x.mean() for x in per_sample) / len(per_sample)


def assert_grads(got: dict, model: torch.nn.Module) -> None:
    ref = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(ref)
    for name, grad in got.items():
        assert_within(grad, ref[name], grad_atol(ref[name]), name)


def actor_grads(hf_dir, samples, **flags) -> dict:
    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=hf_dir, lr=0.0, clip_grad=0.0, **flags))
    backend.train(0, RolloutBatch(samples))
    grads = full_grads(backend.model)
    backend.close()
    return grads


def test_loss_type_policy_and_sft_gradients(one_rank_group, hf_dir):
    """policy_loss (grpo, one step: ratio 1) has gradient -(1/S) sum_i (1/n_i) sum_t A_i
    grad log pi; sft_loss -(1/S) sum_i (1/n_i) sum_t grad log pi. Both against float64."""
    samples = make_samples(n=4, group_size=2)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    adv = []
    for g in range(2):
        r = rewards[2 * g : 2 * g + 2]
        adv += ((r - r.mean()) / (r.std() + 1e-6)).tolist()

    policy = actor_grads(hf_dir, samples, loss_type="policy_loss")
    model = dense_model(hf_dir)
    seq_mean([-a * response_log_probs(model, s) for a, s in zip(adv, samples)]).backward()
    assert_grads(policy, model)

    sft = actor_grads(hf_dir, samples, loss_type="sft_loss")
    model = dense_model(hf_dir)
    seq_mean([-response_log_probs(model, s) for s in samples]).backward()
    assert_grads(sft, model)
    assert any(not torch.allclose(policy[n], sft[n]) for n in policy)


def test_value_loss_gradient_and_critic_training(one_rank_group, hf_dir):
    """The critic's first step: v_old = v, so the clipped value loss is 0.5 (v - R)^2 with R
    the GAE returns, sequence-mean; its gradient against float64. A few more steps (lr > 0)
    bring the values towards the returns."""
    samples = make_samples(n=4, group_size=2)
    backend = critic(hf_dir, lr=0.0, clip_grad=0.0)
    batch = RolloutBatch(samples)
    values = backend.compute_values(batch)
    metrics = backend.train(0, batch.with_fields(values=values))
    grads = full_grads(backend.model)
    backend.close()
    assert {"value_loss", "value_clipfrac"} <= set(metrics)
    assert grads["lm_head.weight"].shape == (1, reference_critic(hf_dir).config.hidden_size)

    model = reference_critic(hf_dir)
    per_sample = []
    for s, v in zip(samples, values):
        rewards = [0.0] * (s.response_length - 1) + [s.reward]
        _, ret = gae(rewards, v.double().tolist())
        pred = reference_values(model, s)
        per_sample.append(0.5 * (pred - torch.tensor(ret, dtype=torch.float64)).square())
    loss = seq_mean(per_sample)
    assert metrics["value_loss"] == pytest.approx(float(loss.detach()), abs=1e-5)
    loss.backward()
    assert_grads(grads, model)

    backend = critic(hf_dir, lr=1e-2)
    before = full_params(backend.model)
    losses = []
    for rollout in range(4):
        values = backend.compute_values(batch)
        losses.append(backend.train(rollout, batch.with_fields(values=values))["value_loss"])
    after = full_params(backend.model)
    backend.close()
    assert losses[-1] < 0.5 * losses[0], losses
    assert not torch.equal(before["lm_head.weight"], after["lm_head.weight"])


def test_the_critic_never_publishes(one_rank_group, hf_dir):
    backend = critic(hf_dir)
    with pytest.raises(ValueError, match="never publishes"):
        backend.update_weights([])
    backend.close()


def test_critic_resumes_bitwise(one_rank_group, hf_dir, tmp_path):
    """Two rollouts straight (saving after the first into <save>/critic) equal a critic resumed
    from <load>/critic that trains the second: weights and AdamW state, bit for bit."""
    batches = [RolloutBatch(make_samples(seed=s)) for s in (11, 12)]

    def step(backend, rollout):
        batch = batches[rollout]
        backend.train(rollout, batch.with_fields(values=backend.compute_values(batch)))

    save = tmp_path / "run"
    straight = critic(hf_dir, lr=1e-2, save=str(save))
    step(straight, 0)
    straight.save_model(0, force_sync=True)
    step(straight, 1)
    want = full_params(straight.model)
    want_opt = straight.optimizer.state_dict()
    straight.close()
    assert (save / "critic" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert not (save / "latest_checkpointed_iteration.txt").exists()  # the actor's is separate

    resumed = FSDPBackend()
    assert (
        resumed.init(make_args(hf_checkpoint=hf_dir, lr=1e-2, load=str(save), **PPO), "critic") == 1
    )
    step(resumed, 1)
    got = full_params(resumed.model)
    got_opt = resumed.optimizer.state_dict()
    resumed.close()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert want_opt["state"]
    for key, state in want_opt["state"].items():
        for field, value in state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(full(got_opt["state"][key][field]), full(value)), (key, field)
