"""Test support: a float64 reference of one rollout (2 optimizer steps) for each configuration of
:data:`estimator_ranks.CONFIGS`, written from the papers with torch and HF transformers only
(no miles code: the samples are the test's data, not a computation).

Notation: sample ``i`` of the rollout has reward ``R_i``, prompt group ``g`` of ``k_g``
samples, loss mask ``m_it`` over its response tokens (tool spans are 0), ``n_i = sum_t m_it``
trained tokens; ``lp_it`` is ``log pi(y_t | y_<t)`` of the current weights, ``old_it`` that of
the weights before the rollout, ``H_it = -sum_v p_v log p_v`` the entropy of the same
distribution. A step over ``S`` samples with ``N`` trained tokens aggregates per-token values
``x_it`` by the sequence mean ``(1/S) sum_i (1/n_i) sum_t m_it x_it``, or by the token mean
``(1/N) sum_it m_it x_it`` (``--calculate-per-token-loss``).

Advantages (one rollout, before it is cut into steps):

* GRPO (Shao et al. 2024, arXiv:2402.03300), GSPO and CISPO's default estimator:
  ``(R_i - mean_g R) / (std_g R + 1e-6)``, unbiased std;
* Dr. GRPO (Liu et al. 2025, arXiv:2503.20783): ``R_i - mean_g R``, no std;
* RLOO (Ahmadian et al. 2024, arXiv:2402.14740): ``R_i - (1/(k_g - 1)) sum_{j != i} R_j``;
* REINFORCE++ (Hu 2025, arXiv:2501.03262): the return of each trained token, ``sum_{l >= t}
  gamma^(l - t) r_l`` with the reward ``R_i`` on the last trained token (gamma 1, no KL reward:
  ``R_i`` on every trained token), then normalised over the batch: ``(A - mu) / sqrt(var +
  1e-8)`` with the mean and population variance over every trained token of the rollout; its
  baseline variant subtracts the group mean reward first.

Objectives (the PPO surrogate of Schulman et al. 2017, arXiv:1707.06347, with eps = 0.2 on both
sides, ratio ``r = exp(lp - old)``):

* PPO: ``x = max(-A r, -A clip(r, 1 - eps, 1 + eps))``, sequence mean; Dr. GRPO sums each
  response's tokens (the mean over responses of ``sum_t m_t x_t``, no ``1/n_i``);
* GSPO (Zheng et al. 2025, arXiv:2507.18071): the sequence ratio ``s_i = exp((1/n_i) sum_t m_it
  (lp_it - old_it))`` in PPO's clip, the gradient of ``s_i`` that of the sequence ratio
  (``sg[s_i] * exp(lp - sg[lp])`` per token);
* CISPO (MiniMax-M1, arXiv:2506.13585): ``x = -sg[clip(r, 1 - eps, 1 + eps)] A lp``,
  normalised by the step's trained tokens (the paper's ``1 / sum |o_i|``);
* entropy bonus: ``- 0.01 * agg(H)``; SFT: ``agg(-lp)``, no bonus;
* for tests/miles_megatron/test_pairwise_flags.py (:class:`Objective`'s other fields): the clip
  range ``[1 - eps_clip, 1 + eps_clip_high]`` (DAPO's clip-higher, arXiv:2503.14476); a KL loss
  ``+ kl_coef * agg(KL)`` with Schulman's k1 / k2 / k3 estimate of ``d = lp - ref`` (the
  reference model is the weights before the rollout); TIS, each token's policy term times
  ``sg[clamp(exp(old - rollout), low, clip)]`` (docs/rl-math.md).

Then per step: backward, the gradient norm before clipping, ``clip_grad_norm_(1.0)``, AdamW
(betas 0.9 / 0.999, eps 1e-8, weight decay 0) at the step's LR: cosine decay from 1e-3 to 1e-4
over 2 steps (Loshchilov & Hutter 2017, arXiv:1608.03983, no restart), ``lr_k = 1e-4 + (1e-3 -
1e-4) (1 + cos(pi k / 2)) / 2``: 1e-3, then 5.5e-4. The rollout's ``S = 4``
samples in rollout order are cut into 2 consecutive slices (step ``k`` trains samples ``[S k /
2, S (k + 1) / 2)``).

:func:`reference` also returns, for each reported value, a bound on what fp32 arithmetic may
change in it, from :mod:`tolerances` (see :func:`reference`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

LR = 1e-3
MIN_LR = 1e-4
DECAY_STEPS = 2
#: the flags of the schedule above, added to every configuration's
SCHEDULE_FLAGS = ("--lr-decay-style", "cosine", "--lr-decay-iters", str(DECAY_STEPS))
SCHEDULE_FLAGS += ("--min-lr", str(MIN_LR))
BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
CLIP_GRAD = 1.0
EPS_CLIP = 0.2
ENTROPY_COEF = 0.01
GROUP_STD_EPS = 1e-6
WHITEN_EPS = 1e-8
STEPS = 2


@dataclass(frozen=True)
class Objective:
    """One configuration: its advantage, objective and aggregation."""

    advantage: str = "grpo"  # grpo, dr_grpo, rloo, reinforce_plus_plus(_baseline)
    policy: str = "ppo"  # ppo, gspo, cispo, sft
    token_mean: bool = False  # --calculate-per-token-loss
    token_sum: bool = False  # Dr. GRPO's per-response token sum
    normalize: bool = False  # --normalize-advantages (REINFORCE++'s batch normalisation)
    entropy_coef: float = ENTROPY_COEF
    kl: str | None = None  # --use-kl-loss's --kl-loss-type: k1, k2, k3, low_var_kl
    kl_coef: float = 0.0  # --kl-loss-coef
    tis: tuple[float, float] | None = None  # --use-tis: (--tis-clip-low, --tis-clip)
    eps_clip: float = EPS_CLIP
    eps_clip_high: float | None = None  # unset: eps_clip


#: the configurations of estimator_ranks.CONFIGS, by name
OBJECTIVES = {
    "grpo": Objective(),
    "gspo": Objective(policy="gspo"),
    "dr_grpo": Objective(advantage="dr_grpo", token_sum=True),
    "rloo": Objective(advantage="rloo"),
    "reinforce_plus_plus": Objective(advantage="reinforce_plus_plus", normalize=True),
    "reinforce_plus_plus_baseline": Objective(
        advantage="reinforce_plus_plus_baseline", normalize=True
    ),
    "cispo": Objective(policy="cispo", token_mean=True),
    "sft_loss": Objective(policy="sft", entropy_coef=0.0),
}


def advantages(obj: Objective, data) -> list[torch.Tensor]:
    """Per-sample, per-response-token advantages (float64; 0 at untrained tokens)."""
    rewards = [float(s.reward) for s in data]
    out = []
    for i, s in enumerate(data):
        group = [rewards[j] for j, o in enumerate(data) if o.group_index == s.group_index]
        mean = sum(group) / len(group)
        if obj.advantage == "grpo":
            a = (rewards[i] - mean) / (statistics.stdev(group) + GROUP_STD_EPS)
        elif obj.advantage in ("dr_grpo", "reinforce_plus_plus_baseline"):
            a = rewards[i] - mean
        elif obj.advantage == "rloo":
            a = rewards[i] - (sum(group) - rewards[i]) / (len(group) - 1)
        elif obj.advantage == "reinforce_plus_plus":
            a = rewards[i]
        else:
            raise ValueError(obj.advantage)
        out.append(a * s.loss_mask.double())  # gamma 1: the final reward on every trained token
    if obj.normalize:
        trained = torch.cat([a[s.loss_mask.bool()] for a, s in zip(out, data)])
        mu, var = trained.mean(), trained.var(unbiased=False)
        out = [
            (a - mu) / (var + WHITEN_EPS).sqrt() * s.loss_mask.double() for a, s in zip(out, data)
        ]
    return out


def scores(model, sample) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lp, H)`` of the response tokens: log-prob of each and the entropy of its distribution."""
    n = sample.response_length
    logits = model(input_ids=sample.tokens[None], use_cache=False).logits[0, -n - 1 : -1]
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, sample.tokens[-n:, None])[:, 0]
    return lp, -(logp.exp() * logp).sum(-1)


def kl_estimate(kind: str, lp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Schulman's estimators of KL(pi || pi_ref) from one sample, ``d = lp - ref``: k1 ``d``,
    k2 ``d^2 / 2``, k3 ``exp(-d) - 1 + d`` (low_var_kl: k3 clamped to [-10, 10];
    http://joschu.net/blog/kl-approx.html, docs/rl-math.md)."""
    d = lp - ref
    if kind == "k1":
        return d
    if kind == "k2":
        return d.square() / 2
    if kind in ("k3", "low_var_kl"):
        return ((-d).exp() - 1 + d).clamp(-10, 10)
    raise ValueError(kind)


def objective(obj, lp, old, entropy, adv, masks, rollout, sg, ref=None) -> dict:
    """One step's loss and metrics from its samples' per-token values. ``sg`` is the stop
    gradient (``detach`` to train; the identity to differentiate the values themselves);
    ``ref`` the reference model's log-probs (for ``obj.kl``).

    ``loss = agg(w pg) - entropy_coef agg(H) + kl_coef agg(KL)``, ``w`` the TIS weight
    ``clamp(exp(old - rollout), low, clip)`` (truncated importance sampling, Yao et al. 2025,
    "Your efficient RL framework secretly brings you off-policy RL training"; no gradient), 1
    without ``--use-tis``; PPO's clip range ``[1 - eps_clip, 1 + eps_clip_high]`` (DAPO's
    clip-higher, arXiv:2503.14476)."""
    masks = [m.double() for m in masks]
    total = sum(float(m.sum()) for m in masks)

    def agg(xs, token_sum=False):
        if obj.token_mean:
            return sum((m * x).sum() for m, x in zip(masks, xs)) / total
        if token_sum:
            return sum((m * x).sum() for m, x in zip(masks, xs)) / len(xs)
        return sum((m * x).sum() / m.sum() for m, x in zip(masks, xs)) / len(xs)

    if obj.policy == "sft":
        loss = agg([-x for x in lp])
        return {"loss": loss, "sft_loss": loss}
    pg, weights = [], []
    high = obj.eps_clip if obj.eps_clip_high is None else obj.eps_clip_high
    for x, o, a, m, r in zip(lp, old, adv, masks, rollout):
        if obj.policy == "gspo":
            seq = (m * (x - o)).sum() / m.sum()
            ratio = sg(seq).exp() * (x - sg(x)).exp()
        else:
            ratio = (x - o).exp()
        clipped = ratio.clamp(1 - obj.eps_clip, 1 + high)
        if obj.policy == "cispo":
            term = -sg(clipped) * a * x
        else:
            term = torch.maximum(-a * ratio, -a * clipped)
        if obj.tis is not None:
            low, clip = obj.tis
            weights.append(sg((o - r).exp().clamp(low, clip)))
            term = weights[-1] * term
        pg.append(term)
    pg_loss = agg(pg, obj.token_sum)
    loss = pg_loss - obj.entropy_coef * agg(entropy, obj.token_sum)
    out = {
        "pg_loss": pg_loss,
        "entropy": agg(entropy),
        "ppo_kl": agg([o - x for x, o in zip(lp, old)]),
        "train_rollout_logprob_abs_diff": agg([(o - r).abs() for o, r in zip(old, rollout)]),
    }
    if obj.kl is not None:
        kl = [kl_estimate(obj.kl, x, f) for x, f in zip(lp, ref)]
        loss = loss + obj.kl_coef * agg(kl, obj.token_sum)
        out["kl_loss"] = agg(kl)
    if weights:
        out["tis"] = agg(weights)
    return {"loss": loss, **out}


def _abs_grads(value: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    grads = torch.autograd.grad(value, inputs, retain_graph=True, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g.abs() for t, g in zip(inputs, grads)]


def _weights_bound(value, params, weight_atol) -> float:
    """First-order bound on how far weight errors ``weight_atol`` move ``value``:
    ``sum_w |d value / d w| * atol_w``."""
    if weight_atol is None:
        return 0.0
    grads = _abs_grads(value, params)
    return float(sum((g * a).sum() for g, a in zip(grads, weight_atol)))


def reference(hf_dir: str, name: str | Objective, data) -> dict:
    """The float64 rollout of configuration ``name`` on ``data`` (the masked samples with
    engine log-probs) from the HF checkpoint ``hf_dir``.

    Returns ``steps``: per step the :func:`objective` values (``grad_norm``, ``lr`` added);
    ``scores``: per step, by sample index, the log-prob and entropy of each response token of
    the step's samples (the values its loss reads) with their bounds
    (backend_reference.score_bounds: ``SCORE_ATOL`` at the first step, then plus
    ``|d score / d w|`` times the weights' ``adam_steps_atol`` distance after the step before:
    :func:`tolerances.moved_score_atol`; inf at untrained tokens); ``log_probs``: each sample's
    response log-probs after both steps; ``after_one``: those after the first step only;
    ``weights``: the weights after both steps (by parameter name); and ``tol``,
    ``log_probs_tol``, ``weights_tol``: the bounds on fp32 arithmetic, with the same keys
    (weights: :func:`tolerances.adam_steps_atol` element by element). A value's bound is
    first order in the per-token errors: ``SCORE_ATOL`` on each
    log-prob and entropy of the forward (times ``|d value / d token value|``), plus, from the
    second step on, the weights' difference after the steps before it
    (:func:`tolerances.adam_steps_atol`) times ``|d value / d w|``, plus 64 ulps of the value.
    A gradient norm moves by at most ``sum_w |g_w| dg_w / |g|`` for a gradient error of
    ``dg_w = (k + 1) GRAD_REL_ERR max|g|`` (per tensor) at step ``k``, the rule
    :func:`tolerances.adam_steps_atol` applies to the gradients. The weights' bounds take the
    peak LR for every step (an upper bound: the schedule only lowers it).
    """
    from backend_reference import score_bounds
    from tolerances import GRAD_REL_ERR, SCORE_ATOL, adam_steps_atol, ulp_atol
    from transformers import AutoModelForCausalLM

    obj = OBJECTIVES[name] if isinstance(name, str) else name
    model = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float64, attn_implementation="eager"
    )
    params = list(model.parameters())
    adv = advantages(obj, data)
    with torch.no_grad():
        old = [scores(model, s)[0] for s in data]
    rollout = [s.rollout_log_probs.double() for s in data]
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=ADAM_EPS, weight_decay=0.0)
    history: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = [[] for _ in params]
    steps, tol, per_token, after_one = [], [], [], None
    n = len(data)
    for k in range(STEPS):
        part = range(n * k // STEPS, n * (k + 1) // STEPS)
        weight_atol = (
            [adam_steps_atol(h, p.detach(), lr=LR, betas=BETAS) for h, p in zip(history, params)]
            if k
            else None
        )
        opt.zero_grad()
        lp, entropy = zip(*(scores(model, data[i]) for i in part))
        olds = [old[i].clone().requires_grad_() for i in part]
        # the reference model is the weights before the rollout: old's values, its own forward
        refs = [old[i].clone().requires_grad_() for i in part]
        args = (
            [adv[i] for i in part],
            [data[i].loss_mask for i in part],
            [rollout[i] for i in part],
        )
        values = objective(obj, list(lp), olds, list(entropy), *args, sg=lambda t: t, ref=refs)
        step_scores = {  # each trained token's log-prob and entropy, as the step computes them
            i: {"log_probs": x.detach(), "entropy": h.detach()}
            | score_bounds(x, h, data[i].loss_mask, params, weight_atol)
            for i, x, h in zip(part, lp, entropy, strict=True)
        }
        bounds = {}
        tokens = [*lp, *entropy, *olds, *refs]
        for key, value in values.items():
            sensitivity = sum(float(g.sum()) for g in _abs_grads(value, tokens))
            bounds[key] = (
                SCORE_ATOL * sensitivity
                + _weights_bound(value, params, weight_atol)
                + float(ulp_atol(value.detach(), 64))
            )
        fixed = [o.detach() for o in olds]
        loss = objective(
            obj, list(lp), fixed, list(entropy), *args, sg=torch.Tensor.detach, ref=fixed
        )["loss"]
        assert abs(float(loss.detach() - values["loss"].detach())) < 1e-12  # one value
        loss.backward()
        grads = [p.grad.detach().clone() for p in params]
        norm = float(torch.nn.utils.clip_grad_norm_(params, CLIP_GRAD))
        dgs = [(k + 1) * GRAD_REL_ERR * float(g.abs().max()) for g in grads]
        bounds["grad_norm"] = sum(float(g.abs().sum()) * d for g, d in zip(grads, dgs)) / norm
        lr = MIN_LR + (LR - MIN_LR) * (1 + math.cos(math.pi * k / DECAY_STEPS)) / 2
        bounds["lr"] = float(ulp_atol(torch.tensor(lr), 1))
        opt.param_groups[0]["lr"] = lr
        opt.step()
        beta1, beta2 = BETAS
        for h, p in zip(history, params):  # what tolerances.adam_steps_atol reads
            state = opt.state[p]
            denom = (state["exp_avg_sq"] / (1 - beta2 ** (k + 1))).sqrt() + ADAM_EPS
            update = state["exp_avg"] / (1 - beta1 ** (k + 1)) / denom
            h.append((p.grad.detach().clone(), denom, update))
        steps.append(
            {**{key: float(v.detach()) for key, v in values.items()}, "grad_norm": norm, "lr": lr}
        )
        tol.append(bounds)
        per_token.append(step_scores)
        if k == 0:
            with torch.no_grad():
                after_one = [scores(model, s)[0] for s in data]
    weight_atol = [
        adam_steps_atol(h, p.detach(), lr=LR, betas=BETAS) for h, p in zip(history, params)
    ]
    names = [name for name, _ in model.named_parameters()]
    weights = {name: p.detach().clone() for name, p in zip(names, params)}
    log_probs, lp_tol = [], []
    for s in data:
        lp, _ = scores(model, s)
        log_probs.append(lp.detach())
        lp_tol.append(
            torch.tensor(
                [SCORE_ATOL + _weights_bound(lp[t], params, weight_atol) for t in range(len(lp))],
                dtype=torch.float64,
            )
        )
    return {
        "steps": steps,
        "tol": tol,
        "scores": per_token,
        "log_probs": log_probs,
        "log_probs_tol": lp_tol,
        "after_one": after_one,
        "old": old,
        "weights": weights,
        "weights_tol": dict(zip(names, weight_atol)),
    }
