"""Advantage estimators and normalization against float64 references written here."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch
from miles_core.advantages import (
    compute_advantages,
    discounted_returns,
    generalized_advantages,
    normalize_advantages,
)
from miles_core.batch import RolloutBatch, Sample

pytestmark = pytest.mark.numeric


def _batch(rewards, groups, resp_lengths, seed=0, all_masked=()):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, (r, gi, n) in enumerate(zip(rewards, groups, resp_lengths)):
        mask = torch.zeros(n) if i in all_masked else (torch.rand(n, generator=g) > 0.3).float()
        samples.append(
            Sample(
                tokens=torch.randint(0, 9, (n + 3,), generator=g),
                response_length=n,
                reward=r,
                loss_mask=mask,
                group_index=gi,
            )
        )
    return RolloutBatch(samples)


def _groups_case(seed=0):
    rng = random.Random(seed)
    groups = [0] * 4 + [1] * 4 + [2] + [3] * 3 + [4] * 2  # incl. a single-sample group
    rewards = [float(rng.choice([0, 1, 0.5, rng.random()])) for _ in groups]
    rewards[9:12] = [1.0, 1.0, 1.0]  # group 3: all tied
    lengths = [rng.randint(1, 9) for _ in groups]
    return rewards, groups, lengths


def _ref_group_stats(rewards, groups, i):
    members = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]
    mean = sum(members) / len(members)
    std = statistics.stdev(members) if len(members) > 1 else 0.0
    return mean, std


@pytest.mark.parametrize("estimator", ["grpo", "gspo"])
def test_grpo_gspo(estimator):
    rewards, groups, lengths = _groups_case()
    batch = _batch(rewards, groups, lengths, all_masked=(2, 12, 13))  # group 4: all masked
    out = compute_advantages(batch, estimator)
    for i, (a, ret) in enumerate(zip(out.advantages, out.returns)):
        mean, std = _ref_group_stats(rewards, groups, i)
        want = (rewards[i] - mean) / (std + 1e-6)
        assert a.shape == (lengths[i],) and torch.equal(a, ret)
        torch.testing.assert_close(a.double(), torch.full((lengths[i],), want, dtype=torch.float64))
    assert out.advantages[8].abs().max() == 0  # single-sample group
    assert all(out.advantages[i].abs().max() == 0 for i in (9, 10, 11))  # ties
    # normalization ignores the all-masked group entirely (and zeroes it)
    masks = [s.mask for s in batch]
    norm = normalize_advantages(out.advantages, masks)
    kept = normalize_advantages(out.advantages[:12], masks[:12])
    assert all(torch.equal(a, b) for a, b in zip(norm[:12], kept))
    assert norm[12].abs().sum() == 0 and norm[13].abs().sum() == 0
    with pytest.raises(ValueError, match="--kl-coef"):
        compute_advantages(batch, estimator, kl_coef=0.1, kl=[torch.zeros(n) for n in lengths])


@pytest.mark.parametrize("baseline", [False, True])
@pytest.mark.parametrize("gamma,kl_coef", [(1.0, 0.0), (0.9, 0.05)])
def test_reinforce_plus_plus(baseline, gamma, kl_coef):
    rewards, groups, lengths = _groups_case(1)
    batch = _batch(rewards, groups, lengths)
    g = torch.Generator().manual_seed(5)
    kl = [torch.randn(n, generator=g) for n in lengths]
    name = "reinforce_plus_plus_baseline" if baseline else "reinforce_plus_plus"
    out = compute_advantages(batch, name, gamma=gamma, kl_coef=kl_coef, kl=kl)
    for i, s in enumerate(batch):
        final = rewards[i] - (_ref_group_stats(rewards, groups, i)[0] if baseline else 0.0)
        n, m = lengths[i], s.loss_mask.tolist()
        r = [-kl_coef * m[t] * kl[i][t].item() for t in range(n)]
        r[-1] += final
        want = [sum(gamma ** (u - t) * r[u] for u in range(t, n)) for t in range(n)]
        torch.testing.assert_close(
            out.advantages[i].double(), torch.tensor(want, dtype=torch.float64)
        )
    with pytest.raises(ValueError, match="--kl-coef needs"):
        compute_advantages(batch, name, kl_coef=0.1)


def test_gae_against_reference():
    rewards, groups, lengths = _groups_case(2)
    batch = _batch(rewards, groups, lengths)
    g = torch.Generator().manual_seed(6)
    values = [torch.randn(n, generator=g) for n in lengths]
    kl = [torch.randn(n, generator=g) for n in lengths]
    gamma, lambd, beta = 0.95, 0.8, 0.02
    out = compute_advantages(
        batch, "ppo", gamma=gamma, lambd=lambd, kl_coef=beta, kl=kl, values=values
    )
    for i, s in enumerate(batch):
        n, v, m = lengths[i], values[i].tolist(), s.loss_mask.tolist()
        r = [-beta * m[t] * kl[i][t].item() for t in range(n)]
        r[-1] += rewards[i]
        want = []
        for t in range(n):  # the non-recursive definition: sum_l (gamma lambd)^l delta_{t+l}
            total = 0.0
            for u in range(t, n):
                delta = r[u] + gamma * (v[u + 1] if u + 1 < n else 0.0) - v[u]
                total += (gamma * lambd) ** (u - t) * delta
            want.append(total)
        want = torch.tensor(want, dtype=torch.float64)
        torch.testing.assert_close(out.advantages[i].double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            out.returns[i].double(),
            want + torch.tensor(v, dtype=torch.float64),
            rtol=1e-5,
            atol=1e-5,
        )
    with pytest.raises(ValueError, match="needs critic values"):
        compute_advantages(batch, "ppo")


def test_gae_with_lambda_one_is_return_minus_value():
    r = torch.tensor([0.0, 0.5, 0.0, 1.0], dtype=torch.float64)
    v = torch.tensor([0.3, -0.2, 0.7, 0.1], dtype=torch.float64)
    adv, ret = generalized_advantages(r, v, 0.9, 1.0)
    torch.testing.assert_close(ret, discounted_returns(r, 0.9))
    torch.testing.assert_close(adv, discounted_returns(r, 0.9) - v)


def test_unknown_estimator():
    with pytest.raises(ValueError, match="--advantage-estimator"):
        compute_advantages(_batch([1.0], [0], [2]), "dpo")


def test_normalize_advantages():
    g = torch.Generator().manual_seed(7)
    lengths = [3, 0 + 1, 6, 4]
    adv = [torch.randn(n, generator=g) * 3 + 1 for n in lengths]
    masks = [(torch.rand(n, generator=g) > 0.3).float() for n in lengths]
    masks[1] = torch.zeros(1)  # an all-masked sample
    out = normalize_advantages(adv, masks)
    vals = [a.item() for a, m in zip(torch.cat(adv), torch.cat(masks)) if m]
    mean = sum(vals) / len(vals)
    var = sum((x - mean) ** 2 for x in vals) / len(vals)
    for a, m, o in zip(adv, masks, out):
        for x, mi, y in zip(a.tolist(), m.tolist(), o.tolist()):
            want = (x - mean) / math.sqrt(var + 1e-8) if mi else 0.0
            assert y == pytest.approx(want, rel=1e-5, abs=1e-6)
    empty = normalize_advantages(adv, [torch.zeros(n) for n in lengths])
    assert all(torch.equal(a, e) for a, e in zip(adv, empty))
