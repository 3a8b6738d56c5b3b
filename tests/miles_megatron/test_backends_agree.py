"""Both backends from one tiny HF checkpoint, 3 rollouts of 2 optimizer steps in fp32 with an
entropy bonus (the loss depends on the weights; the second step's PPO ratio is not 1) and TIS
normalised over each step's batch (--tis-batch-normalize): megatron at TP=2 and FSDP give equal
losses, and equal train/rollout mismatch metrics (extremes included) and mean TIS weights,
within 1e-5. The megatron run also carries the three hooks."""

from __future__ import annotations

import pytest
from dist_ranks import spawn_ranks
from megatron_ranks import rollout_logprob_run, rollout_losses
from megatron_tiny_models import make_tiny_hf
from tolerances import FP32_EPS

pytest.importorskip("miles_fsdp")


@pytest.mark.slow
def test_megatron_and_fsdp_losses_agree(tmp_path):
    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    (m0, hooks), (m1, _) = spawn_ranks(rollout_losses, 2, "megatron", hf_dir, 3, timeout=400)
    ((fsdp, _),) = spawn_ranks(rollout_losses, 1, "fsdp", hf_dir, 3, timeout=400, shim=False)
    assert m0 == m1  # TP peers report the same metrics
    assert len({m[0] for m in fsdp}) == 3  # the loss moves with the weights
    for m, f in zip(m0, fsdp, strict=True):  # rollout_losses' keys, rollout by rollout
        assert all(abs(a - b) < 1e-5 * max(1.0, abs(a)) for a, b in zip(m, f, strict=True)), (
            m0,
            fsdp,
        )
    # the samples carry engine log-probs far from the trainer's: the mismatch is reported, and
    # the TIS weights' step mean is not 1 (the normalisation does something)
    for _, mismatch, std, worst_token, ratio_min, worst_sample, tis_mean in fsdp:
        assert mismatch > 0.1 and std > 0
        assert worst_token >= worst_sample >= mismatch and ratio_min > 0
        assert abs(tis_mean - 1.0) > 1e-3
    assert hooks[0][0] == "init" and hooks[0][1].endswith("Optimizer")
    expected = []
    for rollout in range(3):
        expected += [("log_prob", 4), ("train_step", rollout, 0), ("train_step", rollout, 1)]
    assert hooks[1:] == expected


def hf_first_step_metrics(hf_dir: str) -> dict[str, float]:
    """float64 HF: at the initial weights, with pi_old = the engine's log-probs ``r``, the
    sequence means ``(1/S) sum_i (1/n_i) sum_t m_it x_it`` of ``ppo_kl`` (x = r - log pi) and of
    the mismatch (x = |log pi - r|: the current policy against the engine)."""
    import torch
    from backend_reference import samples
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64)
    data = samples(masked=True, engine_log_probs=True)
    kl, diff = [], []
    with torch.no_grad():
        for s in data:
            logits = model(input_ids=s.tokens[None]).logits[0]
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, s.tokens[1:, None])[:, 0]
            lp = lp[-s.response_length :]
            r, m = s.rollout_log_probs.double(), s.loss_mask.double()
            kl.append(((r - lp) * m).sum() / m.sum())
            diff.append(((lp - r).abs() * m).sum() / m.sum())
    assert all(0 < s.loss_mask.sum() < s.response_length for s in data)  # masks with holes

    # --use-opsm --opsm-delta 0: masked where the GRPO advantage is negative (reward below its
    # group's mean) and the sample's mean log pi_old - log pi (its ppo_kl term) is above 0
    def below_group_mean(s) -> bool:
        group = [o.reward for o in data if o.group_index == s.group_index]
        return s.reward < sum(group) / len(group)

    masked = [below_group_mean(s) and float(k) > 0 for s, k in zip(data, kl)]
    return {
        "ppo_kl": float(sum(kl) / len(kl)),
        "train_rollout_logprob_abs_diff": float(sum(diff) / len(diff)),
        "opsm_masked_samples": float(sum(masked)),
    }


@pytest.mark.slow
def test_use_rollout_logprobs_takes_the_engines_log_probs_as_the_old_policy(tmp_path):
    """--use-rollout-logprobs: pi_old is the engine's log-probs on both backends. With one step,
    ppo_kl, the mismatch and the samples --use-opsm masks against the engine's log-probs equal
    the float64 HF values at the initial weights; with two steps the backends agree and
    Megatron runs no old-log-prob pass (its hook is not called)."""
    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    want = hf_first_step_metrics(hf_dir)
    assert want["opsm_masked_samples"] == 1  # of the two negative-advantage samples: one masked
    # fp32 log-probs of a 2-layer model (64-wide matmuls, a log-softmax over 96 tokens) of
    # magnitude ~5: a few hundred roundings of 2^-24 relative, i.e. ~1e-4 at most
    atol = 256 * FP32_EPS * 8
    runs = {}
    for steps in (1, 2):
        (m0, hooks), (m1, _) = spawn_ranks(
            rollout_logprob_run, 2, "megatron", hf_dir, steps, timeout=400
        )
        ((fsdp, _),) = spawn_ranks(
            rollout_logprob_run, 1, "fsdp", hf_dir, steps, timeout=400, shim=False
        )
        m0.pop("tokens_per_s"), m1.pop("tokens_per_s")  # each rank's own speed
        assert m0 == m1
        runs[steps] = (m0, fsdp, hooks)
    for backend in runs[1][:2]:
        for key, value in want.items():
            assert abs(backend[key] - value) < atol, (key, backend[key], value)
    m0, fsdp, hooks = runs[2]
    for key in ("loss", "ppo_kl", "train_rollout_logprob_abs_diff", "opsm_masked_frac"):
        assert abs(m0[key] - fsdp[key]) < 1e-5, (key, m0[key], fsdp[key])
    # --use-opsm against the engine's log-probs: the same samples masked on both backends
    for steps, (m, f, _) in runs.items():
        assert m["opsm_masked_samples"] == f["opsm_masked_samples"], steps
    assert [h for h in hooks if h[0] == "train_step"] == [
        ("train_step", 0, 0),
        ("train_step", 0, 1),
    ]
    assert not [h for h in hooks if h[0] == "log_prob"]  # no old-log-prob forward
