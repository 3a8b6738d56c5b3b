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

:func:`reference` takes each step from the weights the fp32 run had before it (teacher forcing,
tests/forced_adam.py), with the old policy's and the reference model's log-probs that run's loss
read (inputs it computed before the step, checked on their own), and returns, for each reported
value, a bound on what fp32 arithmetic may change in it, from :mod:`tolerances` (see
:func:`reference`).
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


def check_clip_edges(obj: Objective, lp, old, masks, rollout, run_lp, what: str) -> None:
    """Raise where the float64 step and the fp32 run's (``run_lp``: per sample, the log-probs
    its loss read on each rank that scored it) could clip a trained token differently
    (tolerances.clip_sides_agree): PPO's and GSPO's ratio against ``1 - eps_clip`` and ``1 +
    eps_clip_high`` (the clip switches the token's gradient term off), the TIS weight
    ``exp(old - rollout)`` against its truncations (both runs compute it from the same
    inputs). CISPO's clipped ratio is a value in its gradient, continuous at the edges."""
    from tolerances import clip_sides_agree

    high = obj.eps_clip if obj.eps_clip_high is None else obj.eps_clip_high
    edges = [1 - obj.eps_clip, 1 + high]
    for i, (x, o, m, r, runs) in enumerate(zip(lp, old, masks, rollout, run_lp, strict=True)):
        trained, where = m.bool(), f"{what} sample {i}"
        for y in runs:
            if obj.policy == "ppo":
                clip_sides_agree((x.detach() - o)[trained], (y - o)[trained], edges, where)
            elif obj.policy == "gspo":
                seq = [((m * (z - o)).sum() / m.sum())[None] for z in (x.detach(), y)]
                clip_sides_agree(*seq, edges, where)
        if obj.tis is not None:
            tis = (o - r)[trained]
            clip_sides_agree(tis, tis, list(obj.tis), f"{where} TIS", ulps=4)


def reference(hf_dir: str, name: str | Objective, data, runs: list[dict], perturb=None) -> dict:
    """The float64 rollout of configuration ``name`` on ``data`` (the masked samples with
    engine log-probs) from the HF checkpoint ``hf_dir``, each step from the weights the fp32
    run ``runs`` (every rank's estimator_ranks.estimator_rollouts result of the configuration)
    had before it (``starts``; the weights after the rollout: ``weights``), with the old
    policy's and the reference model's log-probs that run's loss read at the step
    (score_capture.step_inputs; fp32 values, exact in float64). ``perturb(k, named_grads)``,
    if given, may change step ``k``'s float64 gradients before clipping (negative checks).

    Returns ``steps``: per step the :func:`objective` values (``grad_norm``, ``lr`` added);
    ``scores``: per step, by sample index, the log-prob and entropy of each response token of
    the step's samples (the values its loss reads) with their bounds
    (backend_reference.score_bounds: ``SCORE_ATOL``; inf at untrained tokens); ``updates``:
    per step, per weight, the fp32 weights before and after it, the float64 step's and the
    bound (forced_adam.ForcedAdam.step: ``tolerances.adam_forced_step_atol`` at the step's LR);
    ``old``: each sample's response log-probs at the checkpoint's weights (what the run's
    inputs are held to, score_capture.check_inputs); ``after_one``: those at the run's weights
    after the first step; ``log_probs``: those at its weights after the rollout; and ``tol``,
    ``log_probs_tol``: the bounds on fp32 arithmetic, with the same keys. A value's bound is
    first order in the per-token errors: ``SCORE_ATOL`` on each log-prob and entropy of the
    forward (times ``|d value / d token value|``), plus 64 ulps of the value; the gradient
    norm's is ``tolerances.step_norm_atol`` (the gradients of the same weights); the LR's one
    ulp. A token the two steps could clip differently raises (:func:`check_clip_edges`).
    """
    import numpy as np
    from backend_reference import load_reference_model, score_bounds
    from forced_adam import ForcedAdam, snapshot_params
    from safetensors.torch import load_file
    from score_capture import run_log_probs, step_inputs
    from tolerances import SCORE_ATOL, ulp_atol

    obj = OBJECTIVES[name] if isinstance(name, str) else name
    model = load_reference_model(hf_dir)
    adam = ForcedAdam(model, betas=BETAS, eps=ADAM_EPS, clip_grad=CLIP_GRAD)
    first = runs[0]
    assert len(first["starts"]) == STEPS, len(first["starts"])
    base = load_file(f"{hf_dir}/model.safetensors")  # the first step's: the checkpoint's
    assert sorted(first["starts"][0]) == sorted(base), sorted(first["starts"][0])
    assert all(np.array_equal(first["starts"][0][key], base[key].numpy()) for key in base)
    starts = [snapshot_params(model, hf_dir, w) for w in [*first["starts"], first["weights"]]]
    inputs = step_inputs(runs, STEPS)
    adv = advantages(obj, data)
    adam.begin(starts[0])
    with torch.no_grad():
        old = [scores(model, s)[0] for s in data]
    rollout = [s.rollout_log_probs.double() for s in data]
    steps, tol, per_token, updates, after_one = [], [], [], [], None
    n = len(data)
    for k in range(STEPS):
        part = range(n * k // STEPS, n * (k + 1) // STEPS)
        adam.begin(starts[k])
        if k == 1:
            with torch.no_grad():
                after_one = [scores(model, s)[0] for s in data]
        lp, entropy = zip(*(scores(model, data[i]) for i in part))
        # the run's own inputs (SFT reads none: the float64 ones stand in, unused)
        sft = obj.policy == "sft"
        olds = [old[i] if sft else inputs[k][i]["old_log_probs"] for i in part]
        refs = [inputs[k][i]["ref_log_probs"] if obj.kl else None for i in part]
        args = (
            [adv[i] for i in part],
            [data[i].loss_mask for i in part],
            [rollout[i] for i in part],
        )
        run_lp = [run_log_probs(runs, k, i) for i in part]
        check_clip_edges(obj, lp, olds, args[1], args[2], run_lp, f"{name} step {k}")
        values = objective(obj, list(lp), olds, list(entropy), *args, sg=lambda t: t, ref=refs)
        step_scores = {  # each trained token's log-prob and entropy, as the step computes them
            i: {"log_probs": x.detach(), "entropy": h.detach()} | score_bounds(data[i].loss_mask)
            for i, x, h in zip(part, lp, entropy, strict=True)
        }
        bounds = {}
        tokens = [*lp, *entropy]
        for key, value in values.items():  # a value of the run's inputs only: no token's
            grads = _abs_grads(value, tokens) if value.requires_grad else []
            sensitivity = sum(float(g.sum()) for g in grads)
            bounds[key] = SCORE_ATOL * sensitivity + float(ulp_atol(value.detach(), 64))
        loss = objective(
            obj, list(lp), olds, list(entropy), *args, sg=torch.Tensor.detach, ref=refs
        )["loss"]
        assert abs(float(loss.detach() - values["loss"].detach())) < 1e-12  # one value
        loss.backward()
        lr = MIN_LR + (LR - MIN_LR) * (1 + math.cos(math.pi * k / DECAY_STEPS)) / 2
        step = adam.step(lr, starts[k + 1], perturb and (lambda g, k=k: perturb(k, g)))
        bounds["grad_norm"] = step["grad_norm_tol"]
        bounds["lr"] = float(ulp_atol(torch.tensor(lr), 1))
        steps.append(
            {**{key: float(v.detach()) for key, v in values.items()}, "lr": lr}
            | {"grad_norm": step["grad_norm"]}
        )
        tol.append(bounds)
        per_token.append(step_scores)
        updates.append(step["updates"])
    adam.begin(starts[-1])
    with torch.no_grad():
        log_probs = [scores(model, s)[0] for s in data]
    return {
        "steps": steps,
        "tol": tol,
        "scores": per_token,
        "updates": updates,
        "log_probs": log_probs,
        "log_probs_tol": [torch.full_like(x, SCORE_ATOL) for x in log_probs],
        "after_one": after_one,
        "old": old,
    }
