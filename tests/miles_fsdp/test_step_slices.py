"""Several optimizer steps per rollout at DP 2 against a plain float64 reference written here:
step ``k`` trains the rollout's ``k``-th slice of samples whatever the data-parallel layout, and
``--global-batch-size`` gives the same steps as the equivalent ``--num-steps-per-rollout``.

Reference (GRPO, sequence-mean aggregation, PPO clip 0.2): advantages ``A_i`` over each prompt
group of the whole rollout; ``old`` = the log-probs of the weights before the rollout; step ``k``
over the samples ``S_k`` at positions ``[N k / K, N (k+1) / K)`` minimises
``(1/|S_k|) sum_{i in S_k} (1/n_i) sum_t m_it max(-A_i r_it, -A_i clip(r_it, 0.8, 1.2))`` with
``r = exp(log pi - old)``, then one AdamW step (weight decay 0.01, no clipping); the HF model in
float64. Each step is taken from the weights the FSDP run had before it (the first: the
checkpoint's, bit for bit) with the old log-probs its loss read (teacher forcing,
tests/forced_adam.py; those are held to the float64 ones of the checkpoint at every trained
token), and every weight after it is held to ``tolerances.adam_forced_step_atol``; a step that
moved no weight, a step compared with the next one's weights and weights off by a relative
1e-6 are caught.
"""

from __future__ import annotations

import pytest
import samples
import torch
from forced_adam import ForcedAdam, assert_wrong_steps_caught, check_updates
from rank_programs import step_slices_program
from spawn import run_ranks
from tiny_models import save_tiny_model
from tolerances import SCORE_ATOL, assert_within, clip_sides_agree

pytestmark = pytest.mark.numeric

LR = 1e-3
ADAM = dict(betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
EPS_CLIP = 0.2


def response_log_probs(model, sample) -> torch.Tensor:
    logits = model(input_ids=sample.tokens[None], use_cache=False).logits[0]
    n = sample.response_length
    logp = torch.log_softmax(logits[-n - 1 : -1], -1)
    return logp.gather(-1, sample.tokens[-n:, None]).squeeze(-1)


def reference(hf_dir, batch, run) -> dict:
    """The run's AdamW steps over the rollout's slices in float64, each from the weights the
    run had before it (``starts``; after the last: ``params``) with the old log-probs its loss
    read (``old``; where the run's ratio from the log-probs its loss read, ``lp``, and the
    float64 one could clip a token differently, it raises). Returns ``updates`` (per step, forced_adam.ForcedAdam.step's) and ``old``:
    each sample's response log-probs at the checkpoint's weights in float64."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float64, attn_implementation="eager"
    )
    names = [name for name, _ in model.named_parameters()]
    base = load_file(f"{hf_dir}/model.safetensors")  # the first step's: the checkpoint's
    assert all(torch.equal(run["starts"][0][name], base[name]) for name in names)
    snapshots = [*run["starts"], run["params"]]
    starts = [[w[name].double() for name in names] for w in snapshots]
    rewards = torch.tensor([s.reward for s in batch], dtype=torch.float64)
    groups = torch.tensor([s.group_index for s in batch])
    adv = torch.empty_like(rewards)
    for g in groups.unique():
        r = rewards[groups == g]
        adv[groups == g] = (r - r.mean()) / (r.std() + 1e-6)
    adam = ForcedAdam(
        model, betas=ADAM["betas"], eps=ADAM["eps"], weight_decay=ADAM["weight_decay"]
    )
    adam.begin(starts[0])
    with torch.no_grad():
        old = [response_log_probs(model, s) for s in batch]
    n, num_steps = len(batch), len(run["starts"])
    updates = []
    for k in range(num_steps):
        members = range(n * k // num_steps, n * (k + 1) // num_steps)
        assert sorted(run["old"][k]) == list(members), (k, sorted(run["old"][k]))
        adam.begin(starts[k])
        loss = 0.0
        for i in members:
            lp, m = response_log_probs(model, batch[i]), batch[i].loss_mask.double()
            log_ratio = lp - run["old"][k][i]
            edges, trained = [1 - EPS_CLIP, 1 + EPS_CLIP], m.bool()
            run_ratio = run["lp"][k][i] - run["old"][k][i]  # the run clips the same tokens
            clip_sides_agree(log_ratio.detach()[trained], run_ratio[trained], edges, f"{i}")
            ratio = log_ratio.exp()
            token = torch.maximum(
                -adv[i] * ratio, -adv[i] * ratio.clamp(1 - EPS_CLIP, 1 + EPS_CLIP)
            )
            loss = loss + (token * m).sum() / m.sum()
        (loss / len(members)).backward()
        updates.append(adam.step(LR, starts[k + 1])["updates"])
    return {"updates": updates, "old": old}


def check_run(batch, run, ref, what: str) -> None:
    """Each step's weights within their bound of the float64 step from the run's own; the old
    log-probs the run's loss read within ``SCORE_ATOL`` of the checkpoint's float64 ones at
    every trained token."""
    for k, step in enumerate(run["old"]):
        for i, got in step.items():
            m = batch[i].loss_mask.bool()
            tol = torch.full_like(got[m], SCORE_ATOL)
            assert_within(got[m], ref["old"][i][m], tol, f"{what}: step {k} old of {i}")
    check_updates(ref["updates"], what)


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
        run = got[label]
        assert len(run["starts"]) == 2, label
        ref = reference(hf_dir, batch, run)
        check_run(batch, run, ref, label)
        if label == "steps":  # a wrong step, and an old log-prob off by twice its bound
            assert_wrong_steps_caught(ref["updates"], label)
            i = min(run["old"][0])
            old = [dict(step) for step in run["old"]]
            old[0][i] = old[0][i] + 2 * SCORE_ATOL
            with pytest.raises(AssertionError, match="outside the bound"):
                check_run(batch, {**run, "old": old}, ref, f"{label} old off")
