"""--use-tis's weights at token, sequence and geometric-mean level, truncated or masked, with the
veto (miles_core.rollout_correction), against float64 formulas written here sample by sample;
and the flags that shape them refused where they would do nothing."""

from __future__ import annotations

import math

import pytest
import torch
from miles_core.args import ArgumentError, core_groups, parse_args
from miles_core.losses import LossConfig, compute_policy_loss, ppo_clip_loss
from miles_core.rollout_correction import rollout_is_weights
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
     ["--tis-clip", "3"]],
)  # fmt: skip
def test_tis_settings_without_use_tis_are_refused(flags):
    with pytest.raises(ArgumentError, match=f"^{flags[0]} .*--use-tis's weights, which are off"):
        parse_args(flags, core_groups())
    args = parse_args(["--use-tis", *flags], core_groups())
    assert LossConfig.from_args(args).use_tis
