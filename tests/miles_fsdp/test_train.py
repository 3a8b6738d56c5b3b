"""FSDPBackend.train against a plain single-process reference written in the test.

Reference (GRPO, one optimizer step, sequence-mean aggregation): with ``old = sg[log pi]`` the
PPO ratio is 1 and the loss is ``L = (1/S) sum_i (1/n_i) sum_t m_it * (-A_i * log pi_it)`` with
``A_i = (R_i - mean_g R) / (std_g R + 1e-6)``, ``m_it`` the sample's ``loss_mask`` (a masked
tool span in every response) and ``n_i = sum_t m_it``; one AdamW step on the HF model in
float64.
"""

from __future__ import annotations

import pytest
import samples
import torch
from rank_programs import rollout_program
from spawn import run_ranks
from tiny_models import save_tiny_model
from tolerances import adam_step_atol, assert_within

pytestmark = pytest.mark.numeric

LR = 1e-3
ADAM = dict(betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)


def make_samples():
    """The training tests' batch: 8 samples in groups of 4, each with a masked tool span in
    its response (tests/gpu uses it too)."""
    return samples.make_samples(8, group_size=4, masked=True)


def grpo_advantages(samples) -> torch.Tensor:
    """``A_i = (R_i - mean_g R) / (std_g R + 1e-6)``, from the rewards in float64."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    groups = torch.tensor([s.group_index for s in samples])
    adv = torch.empty_like(rewards)
    for g in groups.unique():
        r = rewards[groups == g]
        adv[groups == g] = (r - r.mean()) / (r.std() + 1e-6)
    return adv


def reference_params(hf_dir, samples):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float64, attn_implementation="eager"
    )
    adv = grpo_advantages(samples)
    loss = 0.0
    for s, a in zip(samples, adv):
        logits = model(input_ids=s.tokens[None], use_cache=False).logits[0]
        logp = torch.log_softmax(logits, -1)
        n = s.response_length
        targets = s.tokens[-n:]
        token_logp = logp[-n - 1 : -1].gather(-1, targets[:, None]).squeeze(-1)
        m = s.loss_mask.double()
        loss = loss + (-a * token_logp * m).sum() / m.sum()
    (loss / len(samples)).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, **ADAM)
    optimizer.step()
    return {n: p.detach() for n, p in model.named_parameters()}, grads


@pytest.mark.slow
def test_train_matches_reference_on_two_ranks_any_micro_batching(tmp_path):
    hf_dir = str(save_tiny_model(tmp_path / "qwen3"))
    samples = make_samples()
    common = dict(
        lr=LR,
        adam_beta2=0.98,
        clip_grad=0.0,
        advantage_estimator="grpo",
        use_dynamic_batch_size=True,
    )
    configs = {
        "one_micro": dict(common, max_tokens_per_gpu=256),
        "many_micro": dict(common, max_tokens_per_gpu=16),
    }
    out = tmp_path / "out.pt"
    run_ranks(2, rollout_program, hf_dir, samples, configs, str(out), timeout=300)
    got = torch.load(out, weights_only=True)
    ref, grads = reference_params(hf_dir, samples)
    for label in configs:
        for name, value in ref.items():
            atol = adam_step_atol(grads[name], value, lr=LR, eps=ADAM["eps"])
            assert_within(got[label]["params"][name], value, atol, f"{label}: {name}")
    m = got["one_micro"]["metrics"]
    assert {"pg_loss", "pg_clipfrac", "entropy", "ppo_kl", "grad_norm", "lr"} <= m.keys()
    assert m["pg_clipfrac"] == 0.0 and abs(m["ppo_kl"]) < 1e-7
