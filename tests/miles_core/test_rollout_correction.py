"""--use-tis's weights at token, sequence and geometric-mean level, truncated or masked, with the
veto (miles_core.rollout_correction), against float64 formulas written here sample by sample;
their batch normalisation (--tis-batch-normalize: the step's mean weight over trained tokens or
samples); and the flags that shape them refused where they would do nothing."""

from __future__ import annotations

import math

import pytest
import torch
from miles_core import old_policy
from miles_core.args import ArgumentError, core_groups, parse_args
from miles_core.batch import RolloutBatch, Sample
from miles_core.losses import LossConfig, compute_policy_loss, ppo_clip_loss
from miles_core.rollout_correction import (
    BATCH_MEAN_FIELD,
    batch_mean,
    rollout_is_weights,
    with_batch_mean,
)
from tolerances import FP32_EPS

pytestmark = pytest.mark.numeric

LENGTHS = [6, 3, 9, 5]


def _case(seed: int):
    """Packed fp32 log-probs of four samples and 3 padding positions, a loss mask with holes."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([i for i, n in enumerate(LENGTHS) for _ in range(n)] + [-1] * 3)
    old = (torch.rand(len(ids), generator=g, dtype=torch.float64) * -3).float()
    rollout = (old.double() + 0.3 * torch.randn(len(ids), generator=g, dtype=torch.float64)).float()
    mask = (torch.rand(len(ids), generator=g) > 0.25).float()
    mask[ids < 0] = 0
    return ids, old, rollout, mask


def _reference(old, rollout, mask, ids, level, mode, clip, low, veto):
    """float64 weights, token by token: ``(w, changed, vetoed)`` lists."""
    d = (old.double() - rollout.double()).tolist()
    m, owner = mask.tolist(), ids.tolist()
    per_sample = {}
    for s in set(owner) - {-1}:
        tokens = [t for t in range(len(d)) if owner[t] == s and m[t]]
        total = sum(d[t] for t in tokens)
        per_sample[s] = {
            "sequence": total,
            "geometric": total / max(len(tokens), 1),
            "vetoed": veto is not None and any(math.exp(d[t]) < veto for t in tokens),
        }
    w, changed, vetoed = [], [], []
    for t in range(len(d)):
        s = owner[t]
        info = per_sample.get(max(s, 0))
        log_w = d[t] if level == "token" else info[level]
        raw = math.exp(min(max(log_w, -20.0), 20.0))
        if mode == "truncate":
            value = min(max(raw, low), clip)
            hit = value != raw
        else:
            hit = not low <= raw <= clip
            value = 0.0 if hit else raw
        out = s >= 0 and info["vetoed"]
        w.append(0.0 if out else value)
        changed.append(float(hit))
        vetoed.append(float(out))
    return w, changed, vetoed


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("veto", [None, 0.8])
def test_weights_match_float64(level, mode, veto):
    ids, old, rollout, mask = _case(7)
    # bounds that the case's weights fall on both sides of, at every level
    clip, low = {"token": (1.2, 0.8), "sequence": (1.5, 0.5), "geometric": (1.05, 0.95)}[level]
    w, changed, vetoed = rollout_is_weights(
        old, rollout, level=level, mode=mode, clip=clip, clip_low=low, veto_threshold=veto,
        loss_mask=mask, sample_ids=ids, num_samples=len(LENGTHS),
    )  # fmt: skip
    want_w, want_changed, want_vetoed = _reference(
        old, rollout, mask, ids, level, mode, clip, low, veto
    )
    trained = mask.bool()
    # the case reaches what it names: the bounds change some trained weights and not others,
    # and the veto (when set) rejects some samples and not all
    hits = torch.tensor(want_changed)[trained]
    assert 0 < hits.sum() < trained.sum(), (level, hits)
    if veto is not None:
        rejected = torch.tensor(want_vetoed)[trained]
        assert 0 < rejected.sum() < trained.sum()
    # the log-weight is an fp32 sum of at most 9 differences (partial sums below 9 x 1.5):
    # 18 roundings at magnitude <= 13.5 is an absolute error < 256 ulps of 1, which exp turns
    # into a relative one (and adds its own rounding)
    rel = 256 * FP32_EPS
    for t in range(len(ids)):
        if not trained[t]:
            continue  # padding and untrained tokens: their weight multiplies a masked loss
        assert w[t].item() == pytest.approx(want_w[t], rel=rel), t
        assert changed[t].item() == want_changed[t] and vetoed[t].item() == want_vetoed[t], t


def test_sequence_weights_are_equal_within_a_sample():
    ids, old, rollout, mask = _case(8)
    w, _, _ = rollout_is_weights(
        old, rollout, level="sequence", clip=10.0, loss_mask=mask, sample_ids=ids, num_samples=4
    )
    for s in range(4):
        values = w[(ids == s) & mask.bool()]
        assert len(values) > 1 and (values == values[0]).all()
    assert len({float(w[(ids == s) & mask.bool()][0]) for s in range(4)}) == 4


def test_policy_loss_carries_the_sequence_weights():
    """compute_policy_loss multiplies each token's PPO loss by its sample's weight (token mean)."""
    ids, old, rollout, mask = _case(9)
    lp = old.double() + 0.05
    adv = torch.linspace(-1, 1, len(ids))
    cfg = LossConfig(use_tis=True, tis_level="geometric", tis_mode="mask", tis_clip=1.05,
                     tis_clip_low=0.95, calculate_per_token_loss=True)  # fmt: skip
    loss, metrics = compute_policy_loss(
        lp.float(), old_log_probs=old, advantages=adv, loss_mask=mask, config=cfg,
        denominator=float(mask.sum()), sample_ids=ids, num_samples=4, rollout_log_probs=rollout,
    )  # fmt: skip
    w, changed, _ = _reference(old, rollout, mask, ids, "geometric", "mask", 1.05, 0.95, None)
    pg, _, _ = ppo_clip_loss((lp - old.double()), adv.double(), 0.2)
    want = sum(p * wt * m for p, wt, m in zip(pg.tolist(), w, mask.tolist())) / float(mask.sum())
    assert 0 < sum(c * m for c, m in zip(changed, mask.tolist())) < mask.sum()  # some rejected
    assert loss.item() == pytest.approx(want, rel=1e-5)
    want_clipfrac = sum(c * m for c, m in zip(changed, mask.tolist())) / float(mask.sum())
    assert metrics["tis_clipfrac"].item() == pytest.approx(want_clipfrac, rel=1e-6)


@pytest.mark.parametrize(
    "flags",
    [["--tis-level", "sequence"], ["--tis-mode", "mask"], ["--tis-veto-threshold", "0.01"],
     ["--tis-clip", "3"], ["--tis-batch-normalize"]],
)  # fmt: skip
def test_tis_settings_without_use_tis_are_refused(flags):
    with pytest.raises(ArgumentError, match=f"^{flags[0]} .*--use-tis's weights, which are off"):
        parse_args(flags, core_groups())
    args = parse_args(["--use-tis", *flags], core_groups())
    assert LossConfig.from_algorithm(args.run_config.algorithm).use_tis


def _as_batch(ids, old, rollout, mask) -> RolloutBatch:
    """The packed case as samples (padding dropped), ``old`` as their old-policy field."""
    samples = []
    for s in range(len(LENGTHS)):
        mine = ids == s
        n = int(mine.sum())
        samples.append(
            Sample(
                tokens=torch.arange(n + 2), response_length=n, reward=0.0, loss_mask=mask[mine],
                rollout_log_probs=rollout[mine], fields={"old_log_probs": old[mine]},
            )
        )  # fmt: skip
    return RolloutBatch(samples)


def mean_weight_reference(w: list[float], mask, ids, level: str) -> float:
    """float64: the mean of the weights ``w`` over the trained tokens (token level) or, one per
    sample, over the samples with trained tokens (sequence levels)."""
    m, owner = mask.tolist(), ids.tolist()
    if level == "token":
        kept = [w[t] for t in range(len(w)) if m[t]]
    else:
        kept = []
        for s in sorted(set(owner) - {-1}):
            tokens = [t for t in range(len(w)) if owner[t] == s and m[t]]
            if tokens:
                kept.append(w[tokens[0]])
    return sum(kept) / len(kept)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_batch_mean_matches_float64(level, mode):
    ids, old, rollout, mask = _case(11)
    mask[ids == 1] = 0  # a sample without trained tokens: not in the sequence levels' mean
    clip, low = {"token": (1.2, 0.8), "sequence": (1.5, 0.5), "geometric": (1.05, 0.95)}[level]
    cfg = LossConfig(use_tis=True, tis_level=level, tis_mode=mode, tis_clip=clip,
                     tis_clip_low=low, tis_veto_threshold=0.5, tis_batch_normalize=True)  # fmt: skip
    w, changed, _ = _reference(old, rollout, mask, ids, level, mode, clip, low, 0.5)
    want = mean_weight_reference(w, mask, ids, level)
    got = batch_mean(_as_batch(ids, old, rollout, mask), cfg)
    assert any(c and m for c, m in zip(changed, mask.tolist()))  # the bounds changed some
    assert want != pytest.approx(1.0, abs=1e-3)
    assert got == pytest.approx(want, rel=1e-12)  # float64 from the fp32 inputs, as here
    batch = with_batch_mean(_as_batch(ids, old, rollout, mask), cfg)
    assert all((v == got).all() for v in batch.response_field(BATCH_MEAN_FIELD))
    off = LossConfig(use_tis=True, tis_level=level)
    assert with_batch_mean(_as_batch(ids, old, rollout, mask), off).field_names == (
        "old_log_probs",
    )


def test_batch_mean_of_all_rejected_weights_leaves_them():
    ids, old, rollout, mask = _case(12)
    cfg = LossConfig(use_tis=True, tis_mode="mask", tis_clip=1e-6, tis_clip_low=1e-9,
                     tis_batch_normalize=True)  # fmt: skip
    assert batch_mean(_as_batch(ids, old, rollout, mask), cfg) == 1.0
    assert batch_mean(RolloutBatch([]), cfg) == 1.0


def test_normalized_weights_average_to_one_in_the_loss():
    """Token level, token mean: the loss is the unnormalised one over the mean, and the
    normalised weights' mean over the trained tokens (the metric ``tis``) is 1."""
    ids, old, rollout, mask = _case(13)
    lp = old.double() + 0.05
    adv = torch.linspace(-1, 1, len(ids))
    common = dict(use_tis=True, tis_clip=1.2, tis_clip_low=0.8, calculate_per_token_loss=True)
    w, _, _ = _reference(old, rollout, mask, ids, "token", "truncate", 1.2, 0.8, None)
    mean = mean_weight_reference(w, mask, ids, "token")
    pg, _, _ = ppo_clip_loss((lp - old.double()), adv.double(), 0.2)
    want = sum(p * wt * m for p, wt, m in zip(pg.tolist(), w, mask.tolist()))
    want /= float(mask.sum()) * mean
    loss, metrics = compute_policy_loss(
        lp.float(), old_log_probs=old, advantages=adv, loss_mask=mask,
        config=LossConfig(**common, tis_batch_normalize=True), denominator=float(mask.sum()),
        sample_ids=ids, num_samples=4, rollout_log_probs=rollout,
        tis_batch_mean=torch.where(ids >= 0, mean, 0.0).float(),  # 0 outside responses
    )  # fmt: skip
    assert torch.isfinite(loss) and loss.item() == pytest.approx(want, rel=1e-5)
    assert metrics["tis"].item() == pytest.approx(1.0, rel=1e-6)
    assert metrics["tis_batch_mean"].item() == pytest.approx(mean, rel=1e-6)
    with pytest.raises(ValueError, match="--tis-batch-normalize needs the step's mean weight"):
        compute_policy_loss(
            lp.float(), old_log_probs=old, advantages=adv, loss_mask=mask,
            config=LossConfig(**common, tis_batch_normalize=True), denominator=1.0,
            sample_ids=ids, num_samples=4, rollout_log_probs=rollout,
        )  # fmt: skip


def test_batch_normalize_takes_the_old_policy_from_a_forward_pass():
    """The step's mean weight is needed before its first micro-batch: one step per rollout
    then runs the old-log-prob pass instead of detaching the training forward's."""
    plain = parse_args(["--use-tis"], core_groups())
    normalized = parse_args(["--use-tis", "--tis-batch-normalize"], core_groups())
    assert old_policy.source(plain.run_config.algorithm, plain.run_config.roles) == "current"
    normal = normalized.run_config
    assert old_policy.source(normal.algorithm, normal.roles) == old_policy.FORWARD
    assert old_policy.needs_forward(normal.algorithm, normal.roles)
