"""Advantage estimators (``--advantage-estimator``) and their normalization.

Everything here works on response-aligned per-sample tensors (element ``t`` is response token
``t``). Notation: sample ``i`` has reward ``R_i``, response length ``n``, loss mask ``m_t``,
prompt group ``g(i)``; ``kl_t`` is a per-token KL estimate (``--kl-coef`` puts ``-kl_coef *
kl_t`` into the token rewards of ``reinforce_plus_plus*`` and ``ppo``).

Per-token returns follow the loss mask. A response with tool output or other untrained tokens
(``m_t = 0``) is, for the policy, the sequence of its *trained* tokens ``t_0 < ... < t_{k-1}``
(the positions with ``m_t = 1``): the environment's tokens between two trained tokens are part
of the transition, not actions. Token rewards, critic values, discounting and GAE are taken over
that subsequence only, the reward ``R_i`` sits on the last trained token ``t_{k-1}``, and the
advantage (and return) of an untrained token is 0. A sample with no trained token has advantage
0 everywhere. (Without holes in the mask this is the ordinary per-response recursion.)

* ``grpo`` / ``gspo``: ``A_t = (R_i - mean_g) / (std_g + 1e-6)`` for every token, with the mean
  and the (unbiased) standard deviation over the sample's prompt group; a single-sample group
  has std 0 and advantage 0.
* ``dr_grpo`` (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783):
  ``A_t = R_i - mean_g`` (no division by the std); its loss sums each response's tokens
  without dividing by the response length (:attr:`~miles_core.losses.LossConfig.token_sum`).
* ``rloo`` (Ahmadian et al. 2024, "Back to Basics", arXiv:2402.14740): ``A_t = R_i - (1 / (k -
  1)) sum_{j != i} R_j``, the leave-one-out baseline over the ``k`` samples of the prompt
  group; 0 for a single-sample group.
* ``reinforce_plus_plus``: token rewards ``r_j = -kl_coef * kl_{t_j} + R_i * [j = k - 1]``,
  ``A_{t_j} = G_j = sum_{l >= j} gamma^(l - j) r_l`` (discounted return to the end of the
  response, counting trained tokens only).
* ``reinforce_plus_plus_baseline``: as above with ``R_i - mean_g`` in place of ``R_i``.
* ``ppo``: generalised advantage estimation (Schulman et al. 2016, eq. 16) with critic values
  ``V_j = V_{t_j}`` (``V_k = 0``): ``delta_j = r_j + gamma V_{j+1} - V_j``, ``A_j = delta_j +
  gamma lambd A_{j+1}``, and returns ``A_j + V_j`` for the value loss. The critic's values at
  untrained tokens (which the masked value loss never trains) are never read.

``--custom-advantage-function-path MODULE:FUNC`` replaces the estimator's advantages with
``FUNC(args, batch)`` (:func:`custom_advantages`); ``--advantage-estimator`` still picks the
loss's form (GSPO's ratio, Dr. GRPO's aggregation) and whether a critic runs.

``--normalize-advantages`` then whitens the advantages over all loss tokens of the step on all
DP ranks (:func:`normalize_advantages`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from miles_core.aggregation import all_reduce_host
from miles_core.batch import RolloutBatch, group_members
from miles_core.kl import reward_kl
from miles_core.user_functions import load_function

GROUP_STD_EPS = 1e-6
ESTIMATORS = (
    "grpo",
    "gspo",
    "dr_grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "ppo",
)
#: Estimators whose advantage is one value per sample from its prompt group's rewards.
GROUP_ESTIMATORS = ("grpo", "gspo", "dr_grpo", "rloo")


@dataclass
class Advantages:
    """Per-sample response-aligned advantages and returns (``returns`` equals ``advantages``
    except for ``ppo``, where it is the value-loss target)."""

    advantages: list[torch.Tensor]
    returns: list[torch.Tensor]


def group_normalized_rewards(
    rewards: torch.Tensor, group_indices: Sequence[int], scale_by_std: bool = True
) -> torch.Tensor:
    """``(R_i - mean_g) / (std_g + 1e-6)`` per sample (only ``R_i - mean_g`` without
    ``scale_by_std``); unbiased std, 0 for single-sample groups."""
    rewards = rewards.to(torch.float32)
    out = torch.zeros_like(rewards)
    for members in group_members(group_indices).values():
        r = rewards[members]
        centered = r - r.mean()
        if scale_by_std:
            std = r.std() if len(members) > 1 else torch.zeros(())
            centered = centered / (std + GROUP_STD_EPS)
        out[members] = centered
    return out


def leave_one_out_rewards(rewards: torch.Tensor, group_indices: Sequence[int]) -> torch.Tensor:
    """``R_i - (1 / (k - 1)) sum_{j != i} R_j`` over each prompt group of ``k`` samples (0 for
    a single-sample group)."""
    rewards = rewards.to(torch.float64)
    out = torch.zeros_like(rewards)
    for members in group_members(group_indices).values():
        k = len(members)
        if k > 1:
            r = rewards[members]
            out[members] = r - (r.sum() - r) / (k - 1)
    return out.to(torch.float32)


def discounted_returns(token_rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = sum_{s >= t} gamma^(s - t) r_s`` over a 1-D response (float64 accumulation)."""
    out = []
    running = 0.0
    for r in reversed(token_rewards.tolist()):
        running = r + gamma * running
        out.append(running)
    return torch.tensor(out[::-1], dtype=token_rewards.dtype)


def generalized_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, gamma: float, lambd: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over one response: returns ``(A, A + V)`` (see the module docstring)."""
    rewards, vals = token_rewards.tolist(), values.tolist()
    adv = [0.0] * len(rewards)
    running, next_value = 0.0, 0.0
    for t in range(len(rewards) - 1, -1, -1):
        delta = rewards[t] + gamma * next_value - vals[t]
        running = delta + gamma * lambd * running
        adv[t] = running
        next_value = vals[t]
    out = torch.tensor(adv, dtype=token_rewards.dtype)
    return out, out + values.to(out.dtype)


def compute_advantages(
    batch: RolloutBatch,
    estimator: str,
    *,
    gamma: float = 1.0,
    lambd: float = 1.0,
    kl_coef: float = 0.0,
    kl: Sequence[torch.Tensor] | None = None,
    values: Sequence[torch.Tensor] | None = None,
) -> Advantages:
    """Advantages of every sample of ``batch`` with ``estimator`` (``--advantage-estimator``),
    per-token returns over each sample's trained tokens (see the module docstring).

    ``batch`` must hold whole prompt groups for ``grpo``, ``gspo``, ``dr_grpo``, ``rloo`` and
    ``reinforce_plus_plus_baseline``. ``kl`` (per-sample, response-aligned, e.g.
    ``kl_estimate(old_log_probs, ref_log_probs, "k1")``) is needed when ``kl_coef`` != 0;
    ``values`` (per-sample critic values, response-aligned) for ``ppo``.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(
            f"--advantage-estimator must be one of {', '.join(ESTIMATORS)}, got {estimator!r}"
        )
    masks = [s.mask for s in batch]
    if estimator in GROUP_ESTIMATORS:
        if kl_coef != 0.0:
            raise ValueError(
                f"--kl-coef (KL in the reward) is not used by --advantage-estimator {estimator}; "
                "use --use-kl-loss with --kl-loss-coef"
            )
        if estimator == "rloo":
            scores = leave_one_out_rewards(batch.rewards, batch.group_indices)
        else:
            scale = estimator != "dr_grpo"
            scores = group_normalized_rewards(batch.rewards, batch.group_indices, scale)
        adv = [torch.full((s.response_length,), float(scores[i])) for i, s in enumerate(batch)]
        return Advantages(adv, [a.clone() for a in adv])

    if kl_coef != 0.0 and kl is None:
        raise ValueError("--kl-coef needs per-token KL estimates (reference log-probs)")
    if estimator == "ppo" and values is None:
        raise ValueError(
            "--advantage-estimator ppo needs critic values for every sample (--use-critic)"
        )
    if estimator == "reinforce_plus_plus_baseline":
        final = group_normalized_rewards(batch.rewards, batch.group_indices, scale_by_std=False)
    else:
        final = batch.rewards
    advantages, returns = [], []
    for i, s in enumerate(batch):
        trained = masks[i].nonzero().flatten()
        adv = torch.zeros(s.response_length, dtype=torch.float32)
        ret = torch.zeros(s.response_length, dtype=torch.float32)
        if trained.numel():
            r = torch.zeros(trained.numel(), dtype=torch.float32)
            if kl_coef != 0.0:
                r = r - kl_coef * kl[i].to(torch.float32)[trained]
            r[-1] += float(final[i])
            if estimator == "ppo":
                v = values[i].detach().to(torch.float32)[trained]
                a, g = generalized_advantages(r, v, gamma, lambd)
            else:
                a = g = discounted_returns(r, gamma)
            adv[trained], ret[trained] = a, g
        advantages.append(adv)
        returns.append(ret)
    return Advantages(advantages, returns)


CUSTOM_FLAG = "--custom-advantage-function-path"


def custom_advantages(fn, args, batch: RolloutBatch, values_needed: bool) -> Advantages:
    """``fn(args, batch)`` (``--custom-advantage-function-path``) checked: a list of one
    response-aligned tensor per sample of ``batch`` (this rank's shard, whole prompt groups,
    with the fields attached so far: ``old_log_probs``, ``ref_log_probs``, ``values``...), or
    an :class:`Advantages` (its ``returns`` are the critic's value targets; required when
    ``values_needed``, i.e. under ``ppo``). Masked-out tokens' values are ignored by the loss."""
    out = fn(args, batch)
    if isinstance(out, Advantages):
        adv, ret = out.advantages, out.returns
    elif values_needed:
        raise ValueError(
            f"{CUSTOM_FLAG}: under --advantage-estimator ppo the function must return "
            "Advantages(advantages, returns) (the critic's value targets)"
        )
    else:
        adv = ret = out
    for name, tensors in (("advantages", adv), ("returns", ret)):
        if not isinstance(tensors, (list, tuple)) or len(tensors) != len(batch):
            raise ValueError(
                f"{CUSTOM_FLAG}: expected {name} as a list of {len(batch)} tensors (one per "
                f"sample), got {type(tensors).__name__}"
                + (f" of {len(tensors)}" if isinstance(tensors, (list, tuple)) else "")
            )
        for i, (t, s) in enumerate(zip(tensors, batch)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (s.response_length,):
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"{CUSTOM_FLAG}: {name} of sample {i} is {shape}, expected "
                    f"({s.response_length},) (one value per response token)"
                )
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{CUSTOM_FLAG}: {name} of sample {i} contains NaN or inf")
    as_float = [t.detach().to(torch.float32) for t in adv]
    return Advantages(as_float, [t.detach().to(torch.float32) for t in ret])


def normalize_advantages(
    advantages: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    eps: float = 1e-8,
) -> list[torch.Tensor]:
    """Whiten advantages over the masked tokens of all samples on all ranks of ``group``::

        mu = sum m A / sum m,   var = sum m (A - mu)^2 / sum m,   A' = m (A - mu) / sqrt(var + eps)

    The three sums are all-reduced (float64) when torch.distributed is initialized. Masked-out
    tokens become 0. With no loss token anywhere the advantages are returned unchanged.
    """
    stats = torch.zeros(3, dtype=torch.float64)
    for a, m in zip(advantages, loss_masks):
        a64, m64 = a.detach().to(torch.float64), m.to(torch.float64)
        stats += torch.stack([(a64 * m64).sum(), (a64 * a64 * m64).sum(), m64.sum()])
    stats = all_reduce_host(stats, dist.ReduceOp.SUM, group)
    total, total_sq, count = stats.tolist()
    if count == 0:
        return [a.clone() for a in advantages]
    mean = total / count
    var = max(total_sq / count - mean * mean, 0.0)
    scale = (var + eps) ** -0.5
    return [((a - mean) * scale * m).to(a.dtype) for a, m in zip(advantages, loss_masks)]


def with_advantages(batch: RolloutBatch, args, group: dist.ProcessGroup | None) -> RolloutBatch:
    """``batch`` with its ``advantages`` field, as the flags ask: ``--advantage-estimator``
    (``--gamma``, ``--lambd``) or ``--custom-advantage-function-path``, ``--kl-coef``'s reward KL (``--kl-loss-type``; needs the batch's
    ``old_log_probs`` and ``ref_log_probs``) and ``--normalize-advantages`` (statistics over
    the data-parallel ``group``). What every backend does once per rollout.

    ``ppo`` reads the critic's values from the batch's ``values`` field (attached by the
    launcher before the actor and the critic train) and adds a ``returns`` field, the critic's
    value-loss target, from the advantages before normalization."""
    ppo = args.advantage_estimator == "ppo"
    values = batch.response_field("values") if ppo and "values" in batch.field_names else None
    custom = args.custom_advantage_function_path
    if custom:
        adv = custom_advantages(load_function(custom, CUSTOM_FLAG), args, batch, ppo)
    else:
        adv = compute_advantages(
            batch,
            args.advantage_estimator,
            gamma=args.gamma,
            lambd=args.lambd,
            kl_coef=args.kl_coef,
            kl=reward_kl(batch, args.kl_loss_type) if args.kl_coef != 0.0 else None,
            values=values,
        )
    advantages = adv.advantages
    if args.normalize_advantages:
        advantages = normalize_advantages(advantages, [s.mask for s in batch], group=group)
    if ppo:
        return batch.with_fields(advantages=advantages, returns=adv.returns)
    return batch.with_fields(advantages=advantages)
