"""Test support: MegatronBackend against an HF model trained with torch AdamW (same math), in
float64.

The reference writes the loss from the formulas: GRPO advantages ``(R - mean_g) / (std_g +
1e-6)``, the PPO term at ratio 1 (one update per rollout) and the sequence mean
``(1/S) sum_i (1/n_i) sum_t -m_it A_i r_it`` (``m_it`` each sample's ``loss_mask``: all 1, or
with ``masked`` a masked tool span; ``n_i = sum_t m_it``); then ``clip_grad_norm_(1.0)`` and
``AdamW`` (weight decay 0). The HF model and the optimizer run in float64, each step from the
weights the fp32 run started it from (forced_reference.py), with the bound tests/tolerances.py
derives for one step's fp32 arithmetic on each value (:func:`grpo_step`). :func:`run_backend`
and :func:`check` use the masked samples. Used by tests/miles_megatron/test_backend.py and
test_layouts.py (gloo) and tests/gpu (NCCL)."""

from __future__ import annotations

import torch

LR = 1e-3
REWARDS = (1.0, 0.0, 0.5, 2.0)  # two prompt groups of two samples
GROUPS = (0, 0, 1, 1)
ROLLOUTS = 2
BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
CLIP_GRAD = 1.0


def samples(masked: bool = False, engine_log_probs: bool = False):
    """The four samples; ``masked``: each with a ``loss_mask`` that is 0 on a tool-output span
    after the first response token (``response // 3`` tokens); ``engine_log_probs``: with
    ``rollout_log_probs`` an engine might have reported (about -4.6 = log(1/96) each)."""
    from miles_core.batch import Sample

    gen = torch.Generator().manual_seed(7)
    out = []
    for i, (length, response) in enumerate(((12, 5), (9, 3), (15, 7), (7, 4))):
        tokens = torch.randint(0, 96, (length,), generator=gen)
        mask = torch.ones(response)
        if masked:
            mask[1 : 1 + response // 3] = 0
        out.append(
            Sample(
                tokens=tokens,
                response_length=response,
                reward=REWARDS[i],
                group_index=GROUPS[i],
                loss_mask=mask if masked else None,
                rollout_log_probs=(
                    -4.6 + 0.5 * torch.rand(response, generator=gen) if engine_log_probs else None
                ),
            )
        )
    return out


#: (length, response) of :func:`long_samples`: alone in a row padded to 128 at CP = 2 (chunks of
#: 32, rank 0 holding row positions 0-31 and 96-127), every response reaches both ranks
LONG = ((100, 70), (120, 50), (110, 80), (104, 60))


def long_samples():
    """Four samples long enough that, each packed alone at CP = 2, both CP ranks hold loss
    tokens of each; every loss mask has a hole (a masked tool span of ``response // 4``)."""
    from miles_core.batch import Sample

    gen = torch.Generator().manual_seed(11)
    out = []
    for i, (length, response) in enumerate(LONG):
        mask = torch.ones(response)
        mask[response // 3 : response // 3 + response // 4] = 0
        tokens = torch.randint(0, 96, (length,), generator=gen)
        out.append(Sample(tokens, response, REWARDS[i], group_index=GROUPS[i], loss_mask=mask))
    return out


def backend_argv(hf_dir: str, save: str, tp: int, load: str | None = None) -> list[str]:
    argv = ["--hf-checkpoint", hf_dir, "--save", save, "--lr", str(LR), "--weight-decay", "0"]
    argv += ["--tensor-model-parallel-size", str(tp), "--micro-batch-size", "2"]
    argv += ["--advantage-estimator", "grpo"] + (["--sequence-parallel"] if tp > 1 else [])
    return argv + (["--load", load] if load else [])


def run_backend(hf_dir: str, save: str, tp: int) -> dict:
    """On every rank: train ROLLOUTS rollouts at ``tp`` (``starts``: the weights each rollout's
    step starts from, ``hf_weights()`` under the checkpoint's names; ``scores``: each step's
    log-probs and entropies), save, resume at TP=1 from the save."""
    from megatron_ranks import parse
    from miles_core.batch import RolloutBatch
    from miles_megatron.backend import MegatronBackend
    from score_capture import captured_scores, last_stage

    backend = MegatronBackend()
    first_id = backend.init(parse(backend_argv(hf_dir, save, tp=tp)))
    layout = backend.data_layout()
    data = samples(masked=True)
    batch = RolloutBatch(data) if layout.consumes_data else None
    metrics, scores, starts = [], [], []
    with captured_scores(data) as recorder:  # each step's log-probs and entropies
        for r in range(ROLLOUTS):
            starts.append({k: v.detach().cpu().clone() for k, v in backend.hf_weights()})
            metrics.append(backend.train(r, batch))
            scores.append(recorder.take())
    scores_tokens = last_stage()  # one DP rank: every last-stage rank trains its data
    weights = {k: v.detach().cpu().clone() for k, v in backend.hf_weights()}
    backend.save_model(ROLLOUTS - 1)
    backend.close()
    resumed = MegatronBackend()
    next_id = resumed.init(parse(backend_argv(hf_dir, save + "_2", tp=1, load=save)))
    reloaded = {k: v.detach().cpu() for k, v in resumed.hf_weights()}
    resumed.close()
    return {
        "first_id": first_id,
        "layout": layout,
        "metrics": metrics,
        "next_id": next_id,
        "reload_exact": sorted(reloaded) == sorted(weights)
        and all(torch.equal(reloaded[k], weights[k]) for k in weights),
        "weights": weights,
        "starts": starts,
        "scores": scores,
        "scores_tokens": scores_tokens,
    }


def load_reference_model(hf_dir: str, device: str = "cpu"):
    """``hf_dir``'s HF model in float64 (eager attention and experts) on ``device``."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(  # the grouped-mm experts have no float64
        hf_dir, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager"
    ).to(device)


def grpo_advantages() -> list[float]:
    """Each sample's GRPO advantage ``(R - mean_g) / (std_g + 1e-6)`` (unbiased std)."""
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    adv = []
    for i, g in enumerate(GROUPS):
        members = rewards[[j for j, h in enumerate(GROUPS) if h == g]]
        adv.append(float((rewards[i] - members.mean()) / (members.std() + 1e-6)))
    return adv


def grpo_step(model, data, adv, scores: bool, device: str = "cpu"):
    """One step's float64 loss on ``data`` (its graph kept), the loss's bound and, with
    ``scores``, each sample's :func:`token_scores`.

    The loss's bound: each response token's log-prob (current and old, two fp32 forwards) off
    by at most ``SCORE_ATOL``, times ``|d loss / d lp|`` (the ratio's value is 1), plus ``64 + n`` ulps of ``sum |terms|`` (the loss sums ``n``
    tokens' terms, divides by each sample's count and averages: fewer than ``64 + n``
    roundings, each at most that magnitude)."""
    from tolerances import SCORE_ATOL, ulp_atol

    loss = torch.zeros((), dtype=torch.float64, device=device)
    scale = 0.0  # sum |terms| of the loss
    tokens, scored = [], []
    for s, a in zip(data, adv, strict=True):
        ids = s.tokens.to(device)
        logits = model(input_ids=ids[None], use_cache=False).logits[0]
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
        lp = lp[-s.response_length :]
        old = lp.detach().clone().requires_grad_()  # the old policy: the same weights
        m = s.mask.to(device).double()
        if scores:
            scored.append(token_scores(logits, s, lp, m))
        loss = loss + (-a * torch.exp(lp - old) * m).sum() / m.sum() / len(data)
        scale += abs(a) / len(data)
        tokens += [lp, old]
    sensitivity = sum(
        float(g.abs().sum()) for g in torch.autograd.grad(loss, tokens, retain_graph=True)
    )
    terms = sum(int(s.mask.sum()) for s in data)
    loss_atol = SCORE_ATOL * sensitivity + float(ulp_atol(torch.tensor(scale), 64 + terms))
    return loss, loss_atol, scored


def token_scores(logits, sample, lp, mask) -> dict:
    """One sample's response tokens at one step: float64 ``log_probs`` (``lp``) and ``entropy``
    ``-sum_v p_v log p_v`` of ``logits``' rows, with their :func:`score_bounds`."""
    logp = torch.log_softmax(logits[:-1], -1)[-sample.response_length :]
    entropy = -(logp.exp() * logp).sum(-1)
    out = {"log_probs": lp.detach().cpu(), "entropy": entropy.detach().cpu()}
    return {**out, **score_bounds(mask)}


def score_bounds(mask) -> dict:
    """``log_probs_tol`` and ``entropy_tol`` of one sample's response tokens (``mask``: its
    loss mask) when the fp32 run scored them at the reference's weights: ``SCORE_ATOL`` at the
    trained tokens (``mask`` 1), inf elsewhere."""
    from tolerances import SCORE_ATOL

    trained = mask.cpu() > 0
    out = {}
    for key in ("log_probs_tol", "entropy_tol"):
        tol = torch.full((len(mask),), float("inf"), dtype=torch.float64)
        tol[trained] = SCORE_ATOL
        out[key] = tol
    return out


def check_steps(metrics: list[dict], ref: dict, what: str, keys=("loss", "grad_norm")) -> None:
    """Each rollout's ``keys`` of ``metrics`` within the float64 reference's bound."""
    assert len(metrics) == len(ref["steps"]), (what, len(metrics))
    for k, (m, want, tol) in enumerate(zip(metrics, ref["steps"], ref["tol"], strict=True)):
        for key in keys:
            assert abs(m[key] - want[key]) <= tol[key], (what, k, key, m[key], want[key], tol[key])


def check(results: list[dict], hf_dir: str, device: str = "cpu") -> None:
    """:func:`run_backend`'s ranks against the float64 reference stepped from their own
    weights (forced_reference.check_forced, on ``device``): each rollout's loss and gradient
    norm, each step's log-probs and entropies (score_capture.check_scores), the weights after
    each step; and the resume."""
    from forced_reference import check_forced

    for rank, r in enumerate(results):
        assert r["first_id"] == 0 and r["next_id"] == ROLLOUTS and r["reload_exact"], rank
    first = results[0]
    assert len(first["starts"]) == ROLLOUTS, len(first["starts"])
    check_forced(results, hf_dir, first["starts"], first["weights"], "backend", device=device)
