"""Several optimizer steps per rollout at DP 2 against a plain float64 reference written here:
step ``k`` trains the rollout's ``k``-th slice of samples whatever the data-parallel layout, and
``--global-batch-size`` gives the same steps as the equivalent ``--num-steps-per-rollout``.

Reference (GRPO, sequence-mean aggregation, PPO clip 0.2): advantages ``A_i`` over each prompt
group of the whole rollout; ``old`` = the log-probs of the weights before the rollout; step ``k``
over the samples ``S_k`` at positions ``[N k / K, N (k+1) / K)`` minimises
``(1/|S_k|) sum_{i in S_k} (1/n_i) sum_t m_it max(-A_i r_it, -A_i clip(r_it, 0.8, 1.2))`` with
``r = exp(log pi - old)``, then one AdamW step; the HF model in float64.
"""

from __future__ import annotations

import pytest
import samples
import torch
from rank_programs import step_slices_program
from spawn import run_ranks
from tiny_models import save_tiny_model
from tolerances import adam_steps_atol, assert_within

pytestmark = pytest.mark.numeric

LR = 1e-3
ADAM = dict(betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
EPS_CLIP = 0.2


def response_log_probs(model, sample) -> torch.Tensor:
    logits = model(input_ids=sample.tokens[None], use_cache=False).logits[0]
    n = sample.response_length
    logp = torch.log_softmax(logits[-n - 1 : -1], -1)
    return logp.gather(-1, sample.tokens[-n:, None]).squeeze(-1)


def reference(hf_dir, batch, num_steps):
    """Final float64 weights after ``num_steps`` AdamW steps over the rollout's slices, and per
    parameter each step's ``(gradient, Adam denominator, update direction)``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float64, attn_implementation="eager"
    )
    rewards = torch.tensor([s.reward for s in batch], dtype=torch.float64)
    groups = torch.tensor([s.group_index for s in batch])
    adv = torch.empty_like(rewards)
    for g in groups.unique():
        r = rewards[groups == g]
        adv[groups == g] = (r - r.mean()) / (r.std() + 1e-6)
    with torch.no_grad():
        old = [response_log_probs(model, s) for s in batch]
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, **ADAM)
    steps: dict[str, list] = {name: [] for name, _ in model.named_parameters()}
    n = len(batch)
    beta1, beta2 = ADAM["betas"]
    for k in range(num_steps):
        members = range(n * k // num_steps, n * (k + 1) // num_steps)
        optimizer.zero_grad()
        loss = 0.0
        for i in members:
            ratio = (response_log_probs(model, batch[i]) - old[i]).exp()
            token = torch.maximum(
                -adv[i] * ratio, -adv[i] * ratio.clamp(1 - EPS_CLIP, 1 + EPS_CLIP)
            )
            m = batch[i].loss_mask.double()
            loss = loss + (token * m).sum() / m.sum()
        (loss / len(members)).backward()
        optimizer.step()
        for name, p in model.named_parameters():  # what tolerances.adam_steps_atol reads
            state = optimizer.state[p]
            denom = (state["exp_avg_sq"] / (1 - beta2 ** (k + 1))).sqrt() + ADAM["eps"]
            update = state["exp_avg"] / (1 - beta1 ** (k + 1)) / denom
            steps[name].append((p.grad.detach().clone(), denom.clone(), update.clone()))
    return {name: p.detach() for name, p in model.named_parameters()}, steps


def assert_matches(got, ref, steps, what):
    for name, value in ref.items():
        atol = adam_steps_atol(steps[name], value, lr=LR)
        assert_within(got[name], value, atol, f"{what}: {name}")


@pytest.mark.slow
def test_steps_train_the_rollouts_slices_at_dp_2(tmp_path):
    hf_dir = str(save_tiny_model(tmp_path / "qwen3"))
    fours = samples.make_samples(8, group_size=4, masked=True)  # one prompt group per rank
    pairs = samples.make_samples(8, seed=5, group_size=2, masked=True)
    common = dict(
        lr=LR, clip_grad=0.0, advantage_estimator="grpo", micro_batch_size=2, eps_clip=EPS_CLIP
    )
    rollout = dict(rollout_batch_size=2, n_samples_per_prompt=4)  # 8 samples
    runs = {
        "steps": (fours, dict(common, num_steps_per_rollout=2)),
        "global_batch": (fours, dict(common, **rollout, global_batch_size=4)),
        "pairs": (pairs, dict(common, num_steps_per_rollout=2)),
    }
    out = tmp_path / "out.pt"
    run_ranks(2, step_slices_program, hf_dir, runs, str(out), timeout=400)
    got = torch.load(out, weights_only=True)

    # --global-batch-size 4 of 2 x 4 samples is --num-steps-per-rollout 2, bit for bit
    assert got["global_batch"]["num_steps_per_rollout"] == 2
    assert got["steps"]["steps"] == got["global_batch"]["steps"] == 2
    for name, value in got["steps"]["params"].items():
        assert torch.equal(got["global_batch"]["params"][name], value), name
    timing = ("tokens_per_s", "peak_memory_gb")
    for key, value in got["steps"]["metrics"].items():
        assert key in timing or got["global_batch"]["metrics"][key] == value, key

    for label, batch in (("steps", fours), ("pairs", pairs)):
        ref, steps = reference(hf_dir, batch, 2)
        assert_matches(got[label]["params"], ref, steps, label)
