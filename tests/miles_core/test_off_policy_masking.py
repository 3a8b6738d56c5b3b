"""Off-policy sequence masking (--use-opsm, miles_core.off_policy_masking) against a float64
formula written here sample by sample: a sample with negative advantage whose mean
``log pi_old - log pi`` over its trained tokens exceeds --opsm-delta leaves the policy loss;
the metrics count it; the flags are refused where they would do nothing."""

from __future__ import annotations

import math

import pytest
import torch
from miles_core.args import ArgumentError, core_groups, parse_args
from miles_core.losses import LossConfig, compute_policy_loss

pytestmark = pytest.mark.numeric

LENGTHS = [6, 3, 9, 5, 4]
#: per sample: advantage sign and how far pi_old sits above pi (the mean log-ratio's centre)
ADVANTAGES = [-1.0, -0.5, 0.7, -1.2, -0.8]
SHIFTS = [0.3, 0.01, 0.3, -0.2, 0.5]
DELTA = 0.1


def _case(seed: int):
    """Packed fp32 current and old log-probs of five samples and 3 padding positions, a loss
    mask with holes, per-token advantages constant within a sample."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([i for i, n in enumerate(LENGTHS) for _ in range(n)] + [-1] * 3)
    current = (torch.rand(len(ids), generator=g, dtype=torch.float64) * -3).float()
    shift = torch.tensor([SHIFTS[i] if i >= 0 else 0.0 for i in ids.tolist()], dtype=torch.float64)
    noise = 0.05 * torch.randn(len(ids), generator=g, dtype=torch.float64)
    old = (current.double() + shift + noise).float()
    adv = torch.tensor([ADVANTAGES[i] if i >= 0 else 0.0 for i in ids.tolist()])
    mask = (torch.rand(len(ids), generator=g) > 0.2).float()
    mask[ids < 0] = 0
    return ids, current, old, adv, mask


def _reference(ids, current, old, adv, mask, per_token: bool):
    """float64, sample by sample: (loss, masked samples, masked token fraction) of the PPO
    loss (eps 0.2) with the masked samples' tokens contributing 0."""
    lp, lo, a, m, owner = (x.double().tolist() for x in (current, old, adv, mask, ids))
    masked_samples, terms = set(), []
    for s in range(len(LENGTHS)):
        tokens = [t for t in range(len(lp)) if owner[t] == s and m[t]]
        delta = sum(lo[t] - lp[t] for t in tokens) / max(len(tokens), 1)
        off = a[tokens[0]] < 0 and delta > DELTA
        if off:
            masked_samples.add(s)
        per = []
        for t in tokens:
            r = math.exp(lp[t] - lo[t])
            pg = max(-a[t] * r, -a[t] * min(max(r, 0.8), 1.2))
            per.append(0.0 if off else pg)
        terms.append((per, [1.0 if off else 0.0] * len(tokens)))
    if per_token:
        n = sum(len(p) for p, _ in terms)
        loss = sum(sum(p) for p, _ in terms) / n
        frac = sum(sum(f) for _, f in terms) / n
    else:
        loss = sum(sum(p) / len(p) for p, _ in terms) / len(terms)
        frac = sum(sum(f) / len(f) for _, f in terms) / len(terms)
    return loss, masked_samples, frac


@pytest.mark.parametrize("per_token", [True, False])
def test_opsm_matches_float64(per_token):
    ids, current, old, adv, mask = _case(3)
    want, masked, frac = _reference(ids, current, old, adv, mask, per_token)
    # the case reaches what it names: a negative-advantage sample past delta (masked), one
    # below it and one whose old policy sits below (kept), a positive one past it (kept)
    assert masked == {0, 4}
    n = float(mask.sum()) if per_token else float(len(LENGTHS))
    loss, metrics = compute_policy_loss(
        current.clone(), old_log_probs=old, advantages=adv, loss_mask=mask,
        config=LossConfig(calculate_per_token_loss=per_token, use_opsm=True, opsm_delta=DELTA),
        denominator=n, sample_ids=ids, num_samples=len(LENGTHS),
    )  # fmt: skip
    # fp32 per-token terms of size ~1, sums of <= 27 of them
    assert loss.item() == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert metrics["opsm_masked_frac"].item() == pytest.approx(frac, rel=1e-6)
    assert metrics["opsm_masked_samples"].item() == len(masked)
    _, plain = compute_policy_loss(
        current.clone(), old_log_probs=old, advantages=adv, loss_mask=mask,
        config=LossConfig(calculate_per_token_loss=per_token), denominator=n, sample_ids=ids,
        num_samples=len(LENGTHS),
    )  # fmt: skip
    assert plain["pg_loss"].item() != pytest.approx(want, rel=1e-3)  # the mask does something
    assert "opsm_masked_frac" not in plain


def test_masked_samples_give_no_gradient():
    ids, current, old, adv, mask = _case(4)
    lp = current.clone().requires_grad_(True)
    loss, _ = compute_policy_loss(
        lp, old_log_probs=old, advantages=adv, loss_mask=mask,
        config=LossConfig(calculate_per_token_loss=True, use_opsm=True, opsm_delta=DELTA),
        denominator=float(mask.sum()), sample_ids=ids, num_samples=len(LENGTHS),
    )  # fmt: skip
    loss.backward()
    for s in (0, 4):
        assert (lp.grad[ids == s] == 0).all()
    assert (lp.grad[(ids == 3) & mask.bool()] != 0).all()


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--opsm-delta", "0.5"], "^--opsm-delta 0.5 shapes --use-opsm, which is off"),
        (["--use-opsm"], "^--use-opsm with the current policy as pi_old"),
        (["--use-opsm", "--num-steps-per-rollout", "2", "--opsm-delta", "-1"], "--opsm-delta"),
        (
            ["--use-opsm", "--num-steps-per-rollout", "2", "--loss-type", "sft_loss"],
            "^--loss-type sft_loss ignores --use-opsm",
        ),
    ],
)
def test_opsm_flags_refused_where_they_do_nothing(argv, match):
    with pytest.raises(ArgumentError, match=match):
        parse_args(argv, core_groups())


@pytest.mark.parametrize("extra", [["--use-rollout-logprobs"], ["--num-steps-per-rollout", "2"]])
def test_opsm_accepted_with_an_old_policy_that_differs(extra):
    args = parse_args(["--use-opsm", *extra], core_groups())
    config = LossConfig.from_algorithm(args.run_config.algorithm)
    assert config.use_opsm and config.opsm_delta == 1e-4
