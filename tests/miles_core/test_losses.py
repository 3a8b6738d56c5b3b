"""Losses, KL estimators, log-probs and aggregation against float64 references written here."""

from __future__ import annotations

import math

import pytest
import torch
from miles_core.aggregation import aggregate, segment_sum
from miles_core.args import core_groups, parse_args
from miles_core.kl import kl_estimate
from miles_core.log_probs import entropy_from_logits, token_log_probs
from miles_core.losses import (
    LossConfig,
    cispo_loss,
    compute_policy_loss,
    compute_value_loss,
    gspo_log_ratio,
    ppo_clip_loss,
    sft_loss,
    tis_weights,
)

pytestmark = pytest.mark.numeric

TOL = dict(rtol=1e-5, atol=1e-6)


def _segments(lengths):
    """sample_ids for consecutive segments of ``lengths`` plus 3 padding positions."""
    ids = [i for i, n in enumerate(lengths) for _ in range(n)] + [-1] * 3
    return torch.tensor(ids)


# ---------------------------------------------------------------- references (plain float64 loops)


def ref_ppo(lr, a, lo, hi, c):
    out = []
    for x, adv in zip(lr.tolist(), a.tolist()):
        r = math.exp(min(max(x, -20.0), 20.0))
        loss = max(-adv * r, -adv * min(max(r, 1 - lo), 1 + hi))
        if c is not None and adv < 0:
            loss = min(loss, -adv * c)
        out.append(loss)
    return torch.tensor(out, dtype=torch.float64)


def ref_aggregate(values, mask, ids, per_token, denominator):
    values, mask = values.tolist(), mask.tolist()
    if per_token:
        return sum(v * m for v, m in zip(values, mask)) / denominator
    total = 0.0
    for s in sorted({i for i in ids.tolist() if i >= 0}):
        idx = [t for t, i in enumerate(ids.tolist()) if i == s]
        n = sum(mask[t] for t in idx)
        if n:
            total += sum(values[t] * mask[t] for t in idx) / n
    return total / denominator


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_token_log_probs_and_entropy_at_temperature(temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g) * 3
    targets = torch.randint(0, 11, (2, 5), generator=g)
    lp = token_log_probs(logits, targets, temperature)
    ent = entropy_from_logits(logits, temperature)
    z = logits.double() / temperature
    for b in range(2):
        for t in range(5):
            p = [math.exp(v) for v in z[b, t].tolist()]
            s = sum(p)
            p = [v / s for v in p]
            assert lp[b, t].item() == pytest.approx(math.log(p[targets[b, t]]), rel=1e-5, abs=1e-6)
            assert ent[b, t].item() == pytest.approx(
                -sum(q * math.log(q) for q in p), rel=1e-5, abs=5e-7
            )
    with pytest.raises(ValueError, match="--rollout-temperature"):
        token_log_probs(logits, targets, 0.0)


@pytest.mark.parametrize("kind", ["k1", "kl", "k2", "k3", "low_var_kl"])
def test_kl_estimators(kind):
    g = torch.Generator().manual_seed(1)
    lp = torch.randn(64, generator=g) * 4
    ref = torch.randn(64, generator=g) * 4
    # include ties (log_ratio == 0) and an extreme token that hits the k3 clamp
    ref[:3] = lp[:3]
    lp[3], ref[3] = -30.0, 0.0
    got = kl_estimate(lp, ref, kind)
    for x, y, v in zip(lp.tolist(), ref.tolist(), got.tolist()):
        d = x - y
        if kind in ("k1", "kl"):
            want = d
        elif kind == "k2":
            want = d * d / 2
        else:
            want = min(max(math.exp(-d) - 1 + d, -10.0), 10.0)
        assert v == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert got[:3].abs().max() == 0
    if kind in ("k3", "low_var_kl"):
        assert got[3].item() == 10.0 and bool((got >= 0).all())
    with pytest.raises(ValueError, match="--kl-loss-type"):
        kl_estimate(lp, ref, "k4")


@pytest.mark.parametrize("hi,c", [(None, None), (0.28, None), (0.2, 3.0)])
def test_ppo_clip_loss(hi, c):
    g = torch.Generator().manual_seed(2)
    lr = torch.randn(200, generator=g)
    lr[:4] = torch.tensor([50.0, -50.0, 0.0, 0.0])  # beyond the +-20 clamp, and ties
    adv = torch.randn(200, generator=g) * 2
    adv[4:8] = 0.0
    loss, clipped, dual = ppo_clip_loss(lr, adv, 0.2, hi, c)
    want = ref_ppo(lr.double(), adv.double(), 0.2, 0.2 if hi is None else hi, c)
    torch.testing.assert_close(loss.double(), want, **TOL)
    ratio = lr.clamp(-20, 20).exp()
    lo_b, hi_b = 0.8, 1.2 if hi is None else 1 + hi
    expect_clip = ((adv > 0) & (ratio > hi_b)) | ((adv < 0) & (ratio < lo_b))
    assert torch.equal(clipped.bool(), expect_clip)
    if c is None:
        assert dual.sum() == 0
    else:
        assert torch.equal(dual.bool(), (adv < 0) & (-adv * ratio > -adv * c))
        assert dual.sum() > 0
    assert torch.isfinite(loss).all()


def test_ppo_clip_gradient_is_zero_when_clipped():
    lr = torch.tensor([0.5, -0.5, 0.05], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 1.0])
    loss, _, _ = ppo_clip_loss(lr, adv, 0.2)
    loss.sum().backward()
    assert lr.grad[0] == 0 and lr.grad[1] == 0
    assert lr.grad[2].item() == pytest.approx(-math.exp(0.05))


def test_gspo_log_ratio_value_and_gradient():
    g = torch.Generator().manual_seed(3)
    lengths = [4, 1, 6]
    ids = _segments(lengths)
    lp = torch.randn(len(ids), generator=g, dtype=torch.float64, requires_grad=True)
    old = torch.randn(len(ids), generator=g, dtype=torch.float64)
    mask = (torch.rand(len(ids), generator=g) > 0.3).double()
    mask[ids < 0] = 0
    mask[4] = 1  # the single-token sample trains
    out = gspo_log_ratio(lp, old, mask, ids, 3)
    start = 0
    for n in lengths:
        seg = slice(start, start + n)
        m = mask[seg]
        want = ((lp[seg] - old[seg]) * m).sum() / m.sum().clamp(min=1)
        torch.testing.assert_close(out[seg].detach(), want.detach().expand(n))
        start += n
    # gradient of sum(out * w) is w itself: each token gets d log pi_t only
    w = torch.randn(len(ids), generator=g, dtype=torch.float64)
    (out * w).sum().backward()
    torch.testing.assert_close(lp.grad, w)


def test_tis_weights():
    g = torch.Generator().manual_seed(4)
    old = torch.randn(100, generator=g)
    roll = old + torch.randn(100, generator=g)
    w, truncated = tis_weights(old, roll, 2.0, 0.5)
    for o, r, wi, ti in zip(old.tolist(), roll.tolist(), w.tolist(), truncated.tolist()):
        raw = math.exp(o - r)
        assert wi == pytest.approx(min(max(raw, 0.5), 2.0), rel=1e-5)
        assert ti == float(raw > 2.0 or raw < 0.5)
    assert not w.requires_grad


@pytest.mark.parametrize("per_token", [True, False])
def test_aggregate_and_segment_sum(per_token):
    g = torch.Generator().manual_seed(5)
    lengths = [3, 5, 1, 4]
    ids = _segments(lengths)
    values = torch.randn(len(ids), generator=g)
    mask = (torch.rand(len(ids), generator=g) > 0.4).float()
    mask[ids < 0] = 0
    mask[ids == 1] = 0  # an all-masked sample: contributes 0 to the sequence mean
    got = aggregate(values, mask, 7.0, per_token, ids, 4)
    assert got.item() == pytest.approx(ref_aggregate(values, mask, ids, per_token, 7.0), rel=1e-5)
    sums = segment_sum(values, ids, 4)
    for i in range(4):
        assert sums[i].item() == pytest.approx(values[ids == i].sum().item(), rel=1e-5)
    empty = aggregate(values, torch.zeros_like(mask), 1.0, per_token, ids, 4)
    assert empty.item() == 0.0
    if not per_token:
        with pytest.raises(ValueError, match="sample_ids"):
            aggregate(values, mask, 1.0, False)


def _policy_case(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    ids = _segments(lengths)
    n = len(ids)
    lp = (torch.randn(n, generator=g) - 1).double().requires_grad_(True)
    old = (lp.detach() + 0.3 * torch.randn(n, generator=g).double()).float()
    ref = (lp.detach() + 0.5 * torch.randn(n, generator=g).double()).float()
    roll = (old.double() + 0.4 * torch.randn(n, generator=g).double()).float()
    adv = torch.randn(n, generator=g)
    ent = torch.rand(n, generator=g).double().requires_grad_(True)
    mask = (torch.rand(n, generator=g) > 0.25).float()
    mask[ids < 0] = 0
    return ids, lp, old, ref, roll, adv, ent, mask


@pytest.mark.parametrize(
    ("estimator", "per_token"), [("grpo", True), ("grpo", False), ("gspo", False)]
)  # gspo with a token mean is refused (test_loss_config_from_args_and_validation)
def test_compute_policy_loss_matches_reference(estimator, per_token):
    lengths = [5, 2, 7, 1]
    ids, lp, old, ref, roll, adv, ent, mask = _policy_case(6, lengths)
    cfg = LossConfig(
        advantage_estimator=estimator,
        eps_clip=0.2,
        eps_clip_high=0.28,
        eps_clip_c=3.0,
        use_kl_loss=True,
        kl_loss_coef=0.05,
        kl_loss_type="low_var_kl",
        entropy_coef=0.01,
        use_tis=True,
        tis_clip=1.5,
        tis_clip_low=0.2,
        calculate_per_token_loss=per_token,
    )
    den = 11.0
    loss, metrics = compute_policy_loss(
        lp,
        old_log_probs=old,
        advantages=adv,
        loss_mask=mask,
        config=cfg,
        denominator=den,
        sample_ids=ids,
        num_samples=len(lengths),
        ref_log_probs=ref,
        rollout_log_probs=roll,
        entropy=ent,
    )
    # float64 reference, token by token
    lp64, old64 = lp.detach(), old.double()
    if estimator == "gspo":
        lr = torch.zeros_like(lp64)
        for s in range(len(lengths)):
            sel, m = ids == s, mask.double()[ids == s]
            lr[sel] = ((lp64[sel] - old64[sel]) * m).sum() / max(m.sum().item(), 1)
    else:
        lr = lp64 - old64
    pg = ref_ppo(lr, adv.double(), 0.2, 0.28, 3.0)
    w = (old.double() - roll.double()).exp().clamp(0.2, 1.5)
    d = lp64 - ref.double()
    k3 = ((-d).exp() - 1 + d).clamp(-10, 10)

    def agg(v):
        return ref_aggregate(v, mask.double(), ids, per_token, den)

    want = agg(pg * w) - 0.01 * agg(ent.detach()) + 0.05 * agg(k3)
    assert loss.item() == pytest.approx(want, rel=1e-5)
    assert metrics["loss"].item() == pytest.approx(want, rel=1e-5)
    assert metrics["pg_loss"].item() == pytest.approx(agg(pg * w), rel=1e-5)
    assert metrics["kl_loss"].item() == pytest.approx(agg(k3), rel=1e-5)
    assert metrics["tis"].item() == pytest.approx(agg(w), rel=1e-5)
    assert metrics["ppo_kl"].item() == pytest.approx(agg(old64 - lp64), rel=1e-5, abs=1e-7)
    assert 0 <= metrics["pg_clipfrac"].item() <= 1
    loss.backward()
    assert torch.isfinite(lp.grad).all() and lp.grad[mask == 0].abs().max() == 0
    assert ent.grad is not None and ent.grad.abs().sum() > 0


@pytest.mark.parametrize("per_token", [True, False])
def test_cispo_loss_and_gradient(per_token):
    """CISPO (MiniMax-M1): loss -sg[clip(r, 1 - e_lo, 1 + e_hi)] A log pi, so the
    gradient of each token is -clip(r) A (never zero where the ratio is clipped)."""
    lengths = [5, 2, 7, 1]
    ids, lp, old, _, _, adv, _, mask = _policy_case(11, lengths)
    lo, hi = 0.2, 0.28
    cfg = LossConfig(policy_loss="cispo", eps_clip=lo, eps_clip_high=hi,
                     calculate_per_token_loss=per_token)  # fmt: skip
    loss, metrics = compute_policy_loss(
        lp, old_log_probs=old, advantages=adv, loss_mask=mask, config=cfg, denominator=9.0,
        sample_ids=ids, num_samples=len(lengths),
    )  # fmt: skip
    # float64 reference: the clipped weight is a number, the log-prob the variable
    x = lp.detach().clone().requires_grad_(True)
    weights, clipped = [], []
    for a, b in zip(x.tolist(), old.double().tolist()):
        r = math.exp(min(max(a - b, -20.0), 20.0))
        weights.append(min(max(r, 1 - lo), 1 + hi))
        clipped.append(float(weights[-1] != r))
    w = torch.tensor(weights, dtype=torch.float64)
    pg = -w * adv.double() * x
    m = mask.double()
    if per_token:
        want = (pg * m).sum() / 9.0
    else:
        want = sum((pg[ids == s] * m[ids == s]).sum() / max(m[ids == s].sum(), 1)
                   for s in range(len(lengths))) / 9.0  # fmt: skip
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    loss.backward()
    torch.testing.assert_close(lp.grad, x.grad, rtol=1e-6, atol=1e-9)
    frac = ref_aggregate(torch.tensor(clipped), m, ids, per_token, 9.0)
    assert 0 < sum(c * mk for c, mk in zip(clipped, m.tolist()))  # some ratios were clipped
    assert metrics["pg_clipfrac"].item() == pytest.approx(frac, rel=1e-6)
    assert (lp.grad[mask.bool()] != 0).all()  # clipped tokens keep their gradient
    with pytest.raises(ValueError, match="--policy-loss cispo cannot be used with"):
        LossConfig(policy_loss="cispo", advantage_estimator="gspo")
    with pytest.raises(ValueError, match="--eps-clip-c"):
        LossConfig(policy_loss="cispo", eps_clip_c=3.0)
    assert cispo_loss(torch.zeros(1), torch.zeros(1), torch.ones(1), 0.2)[0].item() == 0.0


def test_dr_grpo_loss_sums_tokens_over_the_sample_count():
    """Dr. GRPO (Liu et al. 2025): (1/S) sum_i sum_t m_t pg_t, no 1/|o_i|; the metrics
    stay means (sequence means over the same S)."""
    lengths = [5, 2, 7, 1]
    ids, lp, old, _, _, adv, ent, mask = _policy_case(12, lengths)
    cfg = LossConfig(advantage_estimator="dr_grpo", eps_clip=0.2, entropy_coef=0.01)
    S = float(len(lengths))
    loss, metrics = compute_policy_loss(
        lp, old_log_probs=old, advantages=adv, loss_mask=mask, config=cfg, denominator=S,
        sample_ids=ids, num_samples=len(lengths), entropy=ent,
    )  # fmt: skip
    lp64, m = lp.detach(), mask.double()
    pg = ref_ppo(lp64 - old.double(), adv.double(), 0.2, 0.2, None)
    want = ((pg - 0.01 * ent.detach()) * m).sum().item() / S
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert metrics["pg_loss"].item() == pytest.approx((pg * m).sum().item() / S, rel=1e-6)
    ent_mean = ref_aggregate(ent.detach(), m, ids, False, S)
    assert metrics["entropy"].item() == pytest.approx(ent_mean, rel=1e-6)
    seq_mean = ref_aggregate(pg, m, ids, False, S)
    assert abs(seq_mean - metrics["pg_loss"].item()) > 1e-3  # not the sequence mean
    with pytest.raises(ValueError, match="dr_grpo cannot be used with --calculate-per-token"):
        LossConfig(advantage_estimator="dr_grpo", calculate_per_token_loss=True)


def test_policy_loss_on_policy_equals_minus_mean_advantage():
    """With old == current log-probs, the ratio is 1 and the loss is -agg(A)."""
    ids = _segments([3, 4])
    lp = torch.randn(len(ids))
    adv = torch.randn(len(ids))
    mask = (ids >= 0).float()
    loss, metrics = compute_policy_loss(
        lp, old_log_probs=lp, advantages=adv, loss_mask=mask, config=LossConfig(),
        denominator=2.0, sample_ids=ids, num_samples=2,
    )  # fmt: skip
    want = -(adv[:3].mean() + adv[3:7].mean()) / 2
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert metrics["pg_clipfrac"].item() == 0.0


@pytest.mark.parametrize("per_token", [True, False])
def test_value_loss(per_token):
    g = torch.Generator().manual_seed(7)
    ids = _segments([4, 6])
    n = len(ids)
    v = torch.randn(n, generator=g)
    old_v = v + torch.randn(n, generator=g) * 0.5
    ret = torch.randn(n, generator=g)
    mask = (ids >= 0).float()
    loss, metrics = compute_value_loss(
        v, old_values=old_v, returns=ret, loss_mask=mask, value_clip=0.2,
        denominator=3.0, per_token_loss=per_token, sample_ids=ids, num_samples=2,
    )  # fmt: skip
    per, clipped = [], []
    for vi, oi, ri in zip(v.tolist(), old_v.tolist(), ret.tolist()):
        vc = oi + min(max(vi - oi, -0.2), 0.2)
        per.append(0.5 * max((vi - ri) ** 2, (vc - ri) ** 2))
        clipped.append(float((vc - ri) ** 2 > (vi - ri) ** 2))
    per, clipped = torch.tensor(per, dtype=torch.float64), torch.tensor(clipped)
    assert loss.item() == pytest.approx(ref_aggregate(per, mask, ids, per_token, 3.0), rel=1e-5)
    want_cf = ref_aggregate(clipped, mask, ids, per_token, 3.0)
    assert metrics["value_clipfrac"].item() == pytest.approx(want_cf, rel=1e-5)


def test_sft_loss():
    ids = _segments([2, 3])
    lp = -torch.rand(len(ids))
    mask = torch.tensor([0, 1, 1, 1, 0, 0, 0, 0], dtype=torch.float32)
    loss, _ = sft_loss(lp, loss_mask=mask, denominator=3.0, per_token_loss=True)
    assert loss.item() == pytest.approx(-(lp[1] + lp[2] + lp[3]).item() / 3, rel=1e-6)


def test_loss_config_from_args_and_validation():
    args = parse_args(
        [
            "--advantage-estimator", "reinforce_plus_plus", "--eps-clip", "0.1", "--use-tis",
            "--tis-clip", "3.0", "--rollout-temperature", "0.8", "--calculate-per-token-loss",
        ],
        core_groups(),
    )  # fmt: skip
    cfg = LossConfig.from_algorithm(args.run_config.algorithm)
    assert cfg.advantage_estimator == "reinforce_plus_plus"
    assert cfg.temperature == 0.8 and cfg.clip_high == 0.1
    assert cfg.tis_clip == 3.0 and cfg.calculate_per_token_loss
    with pytest.raises(ValueError, match="--use-kl-loss and --kl-coef"):
        LossConfig(use_kl_loss=True, kl_coef=0.1)
    with pytest.raises(ValueError, match="--eps-clip-c"):
        LossConfig(eps_clip_c=0.5)
    with pytest.raises(ValueError, match="gspo cannot be used with --calculate-per-token-loss"):
        LossConfig(advantage_estimator="gspo", calculate_per_token_loss=True)
    with pytest.raises(ValueError, match="--advantage-estimator"):
        LossConfig(advantage_estimator="dpo")
    with pytest.raises(ValueError, match="--kl-loss-type"):
        LossConfig(kl_loss_type="k5")
    with pytest.raises(ValueError, match="--use-tis"):
        compute_policy_loss(
            torch.zeros(2), old_log_probs=torch.zeros(2), advantages=torch.zeros(2),
            loss_mask=torch.ones(2), config=LossConfig(use_tis=True), denominator=1.0,
            sample_ids=torch.zeros(2, dtype=torch.long), num_samples=1,
        )  # fmt: skip


def test_sequence_mean_split_across_ranks_with_given_sample_counts():
    """Context parallelism: each rank holds part of every sample. With the full per-sample
    counts given, the parts' sequence-mean shares add up to the whole."""
    g = torch.Generator().manual_seed(8)
    ids = _segments([6, 4, 8])[:-3]
    values = torch.randn(len(ids), generator=g)
    mask = (torch.rand(len(ids), generator=g) > 0.3).float()
    whole = aggregate(values, mask, 3.0, False, ids, 3)
    counts = segment_sum(mask, ids, 3)
    halves = [torch.arange(len(ids)) % 2 == r for r in range(2)]  # interleaved token split
    parts = [
        aggregate(values[h], mask[h], 3.0, False, ids[h], 3, sample_loss_tokens=counts)
        for h in halves
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), rel=1e-6)
    naive = [aggregate(values[h], mask[h], 3.0, False, ids[h], 3) for h in halves]
    assert (naive[0] + naive[1]).item() != pytest.approx(whole.item(), rel=1e-3)


def test_segment_sum_drops_padding_and_keeps_an_empty_batch_in_the_graph():
    # padding (id -1) at the front, the middle and the end; sample 0 receives exact zeros
    values = torch.tensor([5.0, 1.0, -0.5, 7.0, 2.0, 3.0, 9.0], requires_grad=True)
    ids = torch.tensor([-1, 0, 0, -1, 1, 2, -1])
    sums = segment_sum(values, ids, 3)
    assert sums.tolist() == [0.5, 2.0, 3.0]
    sums.sum().backward()
    assert values.grad.tolist() == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    # a rank's empty part of a step: no samples, only padding, and backward still runs
    pad = torch.tensor([1.0, 2.0], requires_grad=True)
    empty = segment_sum(pad, torch.tensor([-1, -1]), 0)
    assert empty.shape == (0,)
    empty.sum().backward()
    assert pad.grad.tolist() == [0.0, 0.0]


def test_loss_config_refuses_the_tis_bounds_the_argument_check_refuses():
    """LossConfig and the argument check agree: --tis-clip-low must be below --tis-clip."""
    from miles_core.args import ArgumentError

    with pytest.raises(ArgumentError, match="must be < --tis-clip"):
        parse_args(["--use-tis", "--tis-clip", "1.5", "--tis-clip-low", "1.5"], core_groups())
    with pytest.raises(ValueError, match=r"must be < --tis-clip \(1.5\)"):
        LossConfig(use_tis=True, tis_clip=1.5, tis_clip_low=1.5)
    LossConfig(use_tis=True, tis_clip=1.5, tis_clip_low=1.4)
