"""Advantage estimators and normalization against float64 references written here."""

from __future__ import annotations

import math
import random
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from miles_core.advantages import (
    compute_advantages,
    discounted_returns,
    generalized_advantages,
    normalize_advantages,
    with_advantages,
)
from miles_core.args import ArgumentError, core_groups, parse_args
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


def _trained(mask) -> list[int]:
    return [t for t, m in enumerate(mask.tolist()) if m]


def _ref_token_rewards(final, kl_coef, kl, trained):
    """Token rewards of the trained-token subsequence: -kl_coef kl at each trained token, the
    sample's reward on the last one."""
    r = [-kl_coef * float(kl[t]) for t in trained]
    r[-1] += final
    return r


def _ref_gae(r, v, gamma, lambd):
    """GAE (Schulman et al. 2016, eq. 16), non-recursive: A_j = sum_l (gamma lambd)^l
    delta_{j+l}, delta_j = r_j + gamma V_{j+1} - V_j, V_k = 0; float64."""
    k = len(r)
    delta = [r[j] + gamma * (v[j + 1] if j + 1 < k else 0.0) - v[j] for j in range(k)]
    return [sum((gamma * lambd) ** (u - j) * delta[u] for u in range(j, k)) for j in range(k)]


def _scatter(values, trained, n):
    out = torch.zeros(n, dtype=torch.float64)
    out[trained] = torch.tensor(values, dtype=torch.float64)
    return out


def _multi_turn_batch(seed=3):
    """Responses whose masks have holes (tool output between turns), end in an untrained
    tool segment, or train nothing at all."""
    g = torch.Generator().manual_seed(seed)
    masks = [
        [1, 1, 0, 0, 1, 1, 1, 0, 1],  # two holes
        [1, 1, 1, 0, 0, 0],  # trailing tool segment
        [0, 0, 1, 0, 1, 1, 0, 0],  # leading, inner and trailing untrained tokens
        [1, 1, 1, 1],  # single turn
        [0, 0, 0],  # nothing trained
        [1],
    ]
    rewards = [1.0, 0.5, -0.3, 0.8, 1.0, 0.2]
    groups = [0, 0, 1, 1, 2, 2]
    samples = [
        Sample(
            tokens=torch.randint(0, 9, (len(m) + 2,), generator=g),
            response_length=len(m),
            reward=r,
            loss_mask=torch.tensor(m, dtype=torch.float32),
            group_index=gi,
        )
        for m, r, gi in zip(masks, rewards, groups)
    ]
    batch = RolloutBatch(samples)
    # the coverage the tests claim: holes, a trailing untrained segment, an all-masked sample
    spans = [m[m.index(1) : len(m) - m[::-1].index(1)] for m in masks if 1 in m]
    assert any(0 in span for span in spans)
    assert any(m[-1] == 0 and 1 in m for m in masks) and any(1 not in m for m in masks)
    return batch, rewards, groups


@pytest.mark.parametrize("baseline", [False, True])
@pytest.mark.parametrize("gamma,kl_coef", [(1.0, 0.0), (0.9, 0.05)])
@pytest.mark.parametrize("multi_turn", [False, True])
def test_reinforce_plus_plus(baseline, gamma, kl_coef, multi_turn):
    """Discounted returns over the trained tokens only, the reward on the last trained token."""
    if multi_turn:
        batch, rewards, groups = _multi_turn_batch()
        lengths = batch.response_lengths
    else:
        rewards, groups, lengths = _groups_case(1)
        batch = _batch(rewards, groups, lengths, all_masked=(3,))
    g = torch.Generator().manual_seed(5)
    kl = [torch.randn(n, generator=g) for n in lengths]
    name = "reinforce_plus_plus_baseline" if baseline else "reinforce_plus_plus"
    out = compute_advantages(batch, name, gamma=gamma, kl_coef=kl_coef, kl=kl)
    for i, s in enumerate(batch):
        final = rewards[i] - (_ref_group_stats(rewards, groups, i)[0] if baseline else 0.0)
        trained = _trained(s.mask)
        want = torch.zeros(lengths[i], dtype=torch.float64)
        if trained:
            r = _ref_token_rewards(final, kl_coef, kl[i], trained)
            k = len(r)
            g_ = [sum(gamma ** (u - j) * r[u] for u in range(j, k)) for j in range(k)]
            want = _scatter(g_, trained, lengths[i])
        torch.testing.assert_close(out.advantages[i].double(), want)
        torch.testing.assert_close(out.returns[i].double(), want)
    with pytest.raises(ValueError, match="--kl-coef needs"):
        compute_advantages(batch, name, kl_coef=0.1)


@pytest.mark.parametrize("multi_turn", [False, True])
def test_gae_against_reference(multi_turn):
    """GAE over each sample's trained-token subsequence against the paper's non-recursive sum."""
    if multi_turn:
        batch, rewards, _ = _multi_turn_batch()
        lengths = batch.response_lengths
    else:
        rewards, groups, lengths = _groups_case(2)
        batch = _batch(rewards, groups, lengths, all_masked=(4,))
    g = torch.Generator().manual_seed(6)
    values = [torch.randn(n, generator=g) for n in lengths]
    kl = [torch.randn(n, generator=g) for n in lengths]
    gamma, lambd, beta = 0.95, 0.8, 0.02
    out = compute_advantages(
        batch, "ppo", gamma=gamma, lambd=lambd, kl_coef=beta, kl=kl, values=values
    )
    holes = 0
    for i, s in enumerate(batch):
        n, trained = lengths[i], _trained(s.mask)
        holes += bool(trained) and trained[-1] - trained[0] + 1 != len(trained)
        adv = ret = torch.zeros(n, dtype=torch.float64)
        if trained:
            r = _ref_token_rewards(rewards[i], beta, kl[i], trained)
            v = [float(values[i][t]) for t in trained]
            a = _ref_gae(r, v, gamma, lambd)
            adv = _scatter(a, trained, n)
            ret = _scatter([x + y for x, y in zip(a, v)], trained, n)
        # fp32 recursion over <= 10 terms of magnitude <= ~10: a few ulps of 10
        torch.testing.assert_close(out.advantages[i].double(), adv, rtol=0, atol=1e-5)
        torch.testing.assert_close(out.returns[i].double(), ret, rtol=0, atol=1e-5)
    assert holes > 0
    with pytest.raises(ValueError, match="needs critic values"):
        compute_advantages(batch, "ppo")


@pytest.mark.parametrize("estimator", ["ppo", "reinforce_plus_plus"])
def test_untrained_tokens_do_not_change_any_advantage(estimator):
    """Values and KL at untrained tokens (tool output) are never read: changing them leaves
    every advantage and return bit for bit the same."""
    batch, _, _ = _multi_turn_batch()
    lengths = batch.response_lengths
    g = torch.Generator().manual_seed(8)
    values = [torch.randn(n, generator=g) for n in lengths]
    kl = [torch.randn(n, generator=g) for n in lengths]
    kw = dict(gamma=0.99, lambd=0.95, kl_coef=0.1)
    base = compute_advantages(batch, estimator, kl=kl, values=values, **kw)
    masks = [s.mask for s in batch]
    values2 = [v + 5.0 * (1 - m) * torch.randn(len(v), generator=g) for v, m in zip(values, masks)]
    kl2 = [x + 5.0 * (1 - m) * torch.randn(len(x), generator=g) for x, m in zip(kl, masks)]
    assert any(not torch.equal(a, b) for a, b in zip(values, values2))
    moved = compute_advantages(batch, estimator, kl=kl2, values=values2, **kw)
    for a, b in zip(base.advantages + base.returns, moved.advantages + moved.returns):
        assert torch.equal(a, b)
    assert all((a * (1 - m)).abs().sum() == 0 for a, m in zip(base.advantages, masks))


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


@pytest.mark.parametrize("estimator", ["rloo", "dr_grpo"])
def test_rloo_and_dr_grpo(estimator):
    """rloo: R_i minus the mean of the other samples of its group (Ahmadian et al. 2024);
    dr_grpo: R_i minus the group mean, no std (Liu et al. 2025). Float64 references."""
    rewards, groups, lengths = _groups_case(3)
    batch = _batch(rewards, groups, lengths)
    out = compute_advantages(batch, estimator)
    for i in range(len(batch)):
        others = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i] and j != i]
        if estimator == "rloo":
            want = rewards[i] - sum(others) / len(others) if others else 0.0
        else:
            want = rewards[i] - _ref_group_stats(rewards, groups, i)[0]
        torch.testing.assert_close(
            out.advantages[i].double(), torch.full((lengths[i],), want, dtype=torch.float64)
        )
    assert groups.count(groups[8]) == 1 and out.advantages[8].abs().max() == 0  # alone
    assert len({rewards[j] for j in range(len(rewards)) if groups[j] == groups[0]}) > 1
    with pytest.raises(ValueError, match="--kl-coef"):
        compute_advantages(batch, estimator, kl_coef=0.1, kl=[torch.zeros(n) for n in lengths])


EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "estimators"


def _flags(**over):
    base = dict(
        advantage_estimator="grpo", gamma=1.0, lambd=1.0, kl_coef=0.0, kl_loss_type="k1",
        normalize_advantages=False, custom_advantage_function_path=None,
    )  # fmt: skip
    return SimpleNamespace(**(base | over))


def wrong_length(args, batch):
    return [torch.zeros(s.response_length + 1) for s in batch]


def plain_list(args, batch):
    return [torch.ones(s.response_length) for s in batch]


def test_custom_advantage_function(monkeypatch):
    """--custom-advantage-function-path hooks:length_penalized (the example) replaces the
    estimator: GRPO's score minus 1e-3 per trained token, against float64; its output is
    checked (one tensor per sample, one value per response token; Advantages under ppo)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    rewards, groups, lengths = _groups_case(4)
    batch = _batch(rewards, groups, lengths)
    out = with_advantages(
        batch, _flags(custom_advantage_function_path="hooks:length_penalized"), None
    )
    for i, s in enumerate(out):
        mean, std = _ref_group_stats(rewards, groups, i)
        want = (rewards[i] - mean) / (std + 1e-6) - 1e-3 * sum(s.loss_mask.tolist())
        torch.testing.assert_close(
            s.fields["advantages"].double(), torch.full((lengths[i],), want, dtype=torch.float64)
        )
    name = __name__
    with pytest.raises(ValueError, match=r"advantages of sample 0 is \(\d+,\), expected"):
        with_advantages(batch, _flags(custom_advantage_function_path=f"{name}:wrong_length"), None)
    ppo = _flags(advantage_estimator="ppo", custom_advantage_function_path=f"{name}:plain_list")
    with pytest.raises(ValueError, match="must return Advantages"):
        with_advantages(batch, ppo, None)
    with pytest.raises(ArgumentError, match="cannot import no_such_module"):
        parse_args(["--custom-advantage-function-path", "no_such_module:f"],
                   core_groups())  # fmt: skip
    with pytest.raises(ArgumentError, match="--custom-advantage-function-path with --kl-coef"):
        parse_args(["--custom-advantage-function-path", f"{name}:plain_list", "--kl-coef", "0.1",
                    "--ref-load", "/r"], core_groups())  # fmt: skip
