"""The train/rollout mismatch metrics (miles_core.mismatch), as the loss reports them, against
float64 formulas written here: mean |log pi_train - log pi_rollout|, the K3 estimate
r - 1 - log r, the importance ratio's mean and standard deviation, the fraction of tokens past
the threshold; over the trained tokens only, token or sequence mean; the extremes (token
maximum of |log r|, minimum and maximum of r, the worst sample's mean |log r| and K3) over
micro-batches and optimizer steps."""

from __future__ import annotations

import math

import pytest
import torch
from miles_core import mismatch
from miles_core.losses import LossConfig, compute_policy_loss
from miles_core.metric_reduction import StepMetrics, over_steps
from tolerances import FP32_EPS

pytestmark = pytest.mark.numeric

NAMES = (
    mismatch.ABS_DIFF,
    mismatch.K3_KL,
    mismatch.RATIO_MEAN,
    mismatch.RATIO_STD,
    mismatch.PAST_THRESHOLD,
)


def _case(seed: int, lengths: list[int]):
    """fp32 log-probs of packed samples (3 padding positions), a loss mask with holes, and the
    same values in float64."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([i for i, n in enumerate(lengths) for _ in range(n)] + [-1] * 3)
    train = (torch.rand(len(ids), generator=g, dtype=torch.float64) * -3).float()
    rollout = (
        train.double() + 0.4 * torch.randn(len(ids), generator=g, dtype=torch.float64)
    ).float()
    mask = (torch.rand(len(ids), generator=g) > 0.25).float()
    mask[ids < 0] = 0
    return ids, train, rollout, mask


def _reported(train, rollout, mask, ids, per_token: bool, num_samples: int) -> dict[str, float]:
    """The metrics as a rollout of one step reports them: the loss's masked means, finished."""
    n = float(mask.sum()) if per_token else float(num_samples)
    _, metrics = compute_policy_loss(
        train.clone(),
        old_log_probs=train,
        advantages=torch.ones_like(train),
        loss_mask=mask,
        config=LossConfig(calculate_per_token_loss=per_token),
        denominator=n,
        sample_ids=ids,
        num_samples=num_samples,
        rollout_log_probs=rollout,
    )
    step = StepMetrics()
    step.add(metrics)
    return mismatch.finish(over_steps([step.reduce()[0]]))


def _reference(train, rollout, mask, ids, per_token: bool) -> dict[str, float]:
    """float64, token by token: each sample's masked mean (or the pooled token mean)."""
    d = (train.double() - rollout.double()).tolist()
    m = mask.tolist()
    if per_token:
        groups = [[t for t in range(len(d)) if m[t]]]
    else:
        groups = [
            [t for t, i in enumerate(ids.tolist()) if i == s and m[t]]
            for s in sorted({i for i in ids.tolist() if i >= 0})
        ]
        groups = [g for g in groups if g]

    def mean_of(f) -> float:
        return sum(sum(f(d[t]) for t in g) / len(g) for g in groups) / len(groups)

    ratio = mean_of(math.exp)
    return {
        mismatch.ABS_DIFF: mean_of(abs),
        mismatch.K3_KL: mean_of(lambda x: math.exp(x) - 1 - x),
        mismatch.RATIO_MEAN: ratio,
        mismatch.RATIO_STD: math.sqrt(mean_of(lambda x: math.exp(2 * x)) - ratio**2),
        mismatch.PAST_THRESHOLD: mean_of(lambda x: float(abs(x) > mismatch.THRESHOLD)),
    }


def _atol(num_tokens: int) -> float:
    """A masked mean of ``num_tokens`` fp32 terms of size at most ~e (|log r| < 1 here), each
    a few roundings (sub, exp, the K3 difference): ``num_tokens`` accumulated roundings of the
    sum, ~8 per term, times the largest term. The standard deviation is a square root of a
    difference of such means (cancellation divides by 2*std ~ 0.8): counted twice."""
    return 2 * 8 * num_tokens * FP32_EPS * math.e


@pytest.mark.parametrize("per_token", [True, False])
def test_mismatch_metrics_match_float64(per_token):
    lengths = [6, 3, 9, 5]
    ids, train, rollout, mask = _case(3, lengths)
    got = _reported(train, rollout, mask, ids, per_token, len(lengths))
    want = _reference(train, rollout, mask, ids, per_token)
    # the case reaches what it names: holes in the mask, tokens on both sides of the threshold
    d = (train.double() - rollout.double()).abs()[mask.bool()]
    assert 0 < mask.sum() < (ids >= 0).sum()
    assert (d > mismatch.THRESHOLD).any() and (d < mismatch.THRESHOLD).any()
    assert ((d - mismatch.THRESHOLD).abs() > 1e-4).all()  # no token at the threshold's edge
    for name in NAMES:
        assert got[name] == pytest.approx(want[name], abs=_atol(len(ids))), name
    assert mismatch._RATIO_SQ not in got  # finish() removed the intermediate


def test_masked_tokens_do_not_count():
    """A token outside the loss mask (a tool output, padding) may differ by anything."""
    lengths = [6, 3, 9, 5]
    ids, train, rollout, mask = _case(4, lengths)
    hole = int((mask == 0).nonzero()[0])
    wild = rollout.clone()
    wild[hole] = train[hole] - 15.0
    assert _reported(train, wild, mask, ids, True, 4) == _reported(
        train, rollout, mask, ids, True, 4
    )


def test_no_mismatch_is_exactly_zero():
    ids, train, _, mask = _case(5, [4, 4])
    got = _reported(train, train.clone(), mask, ids, True, 2)
    assert got[mismatch.ABS_DIFF] == got[mismatch.K3_KL] == got[mismatch.PAST_THRESHOLD] == 0.0
    assert got[mismatch.RATIO_MEAN] == 1.0 and got[mismatch.RATIO_STD] == 0.0


def test_without_engine_log_probs_nothing_is_reported():
    ids, train, _, mask = _case(6, [4, 4])
    _, metrics = compute_policy_loss(
        train.clone(), old_log_probs=train, advantages=torch.ones_like(train), loss_mask=mask,
        config=LossConfig(calculate_per_token_loss=True), denominator=float(mask.sum()),
    )  # fmt: skip
    assert not set(metrics) & {*NAMES, mismatch._RATIO_SQ}


EXTREMES = (
    mismatch.ABS_DIFF_MAX,
    mismatch.RATIO_MIN,
    mismatch.RATIO_MAX,
    mismatch.ABS_DIFF_SAMPLE_MAX,
    mismatch.K3_SAMPLE_MAX,
)


def _extremes_reference(train, rollout, mask, ids) -> dict[str, float]:
    """float64 from the definitions: over the trained tokens, max |d|, min and max exp(d);
    over the samples, the largest mean over the sample's trained tokens of |d| and of
    exp(d) - 1 - d (a sample without trained tokens: 0)."""
    d = (train.double() - rollout.double()).tolist()
    m, owner = mask.tolist(), ids.tolist()
    kept = [d[t] for t in range(len(d)) if m[t]]
    per_sample = {"abs": [], "k3": []}
    for s in sorted({i for i in owner if i >= 0}):
        mine = [d[t] for t in range(len(d)) if owner[t] == s and m[t]]
        n = max(len(mine), 1)
        per_sample["abs"].append(sum(abs(x) for x in mine) / n)
        per_sample["k3"].append(sum(math.exp(x) - 1 - x for x in mine) / n)
    return {
        mismatch.ABS_DIFF_MAX: max(abs(x) for x in kept),
        mismatch.RATIO_MIN: min(math.exp(x) for x in kept),
        mismatch.RATIO_MAX: max(math.exp(x) for x in kept),
        mismatch.ABS_DIFF_SAMPLE_MAX: max(per_sample["abs"]),
        mismatch.K3_SAMPLE_MAX: max(per_sample["k3"]),
    }


def _micro_batch(train, rollout, mask, ids, samples: list[int]):
    """The tokens of ``samples``, renumbered 0.. as a packed micro-batch numbers them."""
    keep = torch.tensor([i in samples for i in ids.tolist()])
    local = torch.tensor([samples.index(i) for i in ids[keep].tolist()])
    return train[keep], rollout[keep], mask[keep], local


def _metrics_of(micro_batch, per_token: bool, denominator: float) -> dict[str, torch.Tensor]:
    train, rollout, mask, ids = micro_batch
    num_samples = int(ids.max()) + 1
    _, metrics = compute_policy_loss(
        train.clone(), old_log_probs=train, advantages=torch.ones_like(train), loss_mask=mask,
        config=LossConfig(calculate_per_token_loss=per_token), denominator=denominator,
        sample_ids=ids, num_samples=num_samples, rollout_log_probs=rollout,
    )  # fmt: skip
    return metrics


@pytest.mark.parametrize("per_token", [True, False])
def test_extremes_over_micro_batches_and_steps_match_float64(per_token):
    """Two optimizer steps of two micro-batches each (samples 0-2 | 3-4 and 5 | 6-7): the
    extremes of the rollout are those of all its trained tokens and samples; the worst sample
    sits in the second step (an engine that sampled it from other weights)."""
    lengths = [6, 3, 9, 5, 4, 7, 5, 8]
    ids, train, rollout, mask = _case(8, lengths)
    rollout[ids == 6] -= 1.5  # sample 6: far from the trainer on every token
    mask[(ids == 4).nonzero()[:, 0]] = 0  # sample 4: no trained token (counts 0)
    steps = []
    for step_samples in (([0, 1, 2], [3, 4]), ([5], [6, 7])):
        in_step = [s for part in step_samples for s in part]
        n = float(sum(mask[ids == s].sum() for s in in_step)) if per_token else len(in_step)
        acc = StepMetrics()
        for samples in step_samples:
            acc.add(_metrics_of(_micro_batch(train, rollout, mask, ids, samples), per_token, n))
        steps.append(acc.reduce()[0])
    got = mismatch.finish(over_steps(steps))
    want = _extremes_reference(train, rollout, mask, ids)
    # the worst sample's mean and the worst token are different samples' (they are not the same
    # number by construction)
    assert got[mismatch.ABS_DIFF_SAMPLE_MAX] < got[mismatch.ABS_DIFF_MAX]
    for name in EXTREMES:
        # one fp32 subtraction (and exp) per token; a sample mean of <= 9 such terms
        assert got[name] == pytest.approx(want[name], rel=64 * FP32_EPS, abs=_atol(9)), name


def test_extremes_ignore_masked_tokens_and_leave_out_what_saw_nothing():
    ids, train, rollout, mask = _case(9, [4, 4])
    wild = rollout.clone()
    wild[mask == 0] = train[mask == 0] - 15.0
    assert _reported(train, wild, mask, ids, True, 2) == _reported(
        train, rollout, mask, ids, True, 2
    )
    nothing = _reported(train, rollout, torch.zeros_like(mask), ids, True, 2)
    assert not {mismatch.ABS_DIFF_MAX, mismatch.RATIO_MIN, mismatch.RATIO_MAX} & set(nothing)
    assert nothing[mismatch.ABS_DIFF_SAMPLE_MAX] == 0.0  # every sample counts 0
