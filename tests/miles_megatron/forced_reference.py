"""Test support: the layout suites' float64 HF + AdamW reference stepped from the fp32 run's own
weights (teacher forcing), so that each optimizer step is held to one step's rounding
(tests/miles_megatron/test_layouts.py).

A free-running comparison (backend_reference.reference) runs the float64 job from the
checkpoint alone and must bound, at step ``k``, how far the fp32 weights have drifted from it
by then: ``tolerances.adam_steps_atol`` assumes the gradient error grows as ``k + 1`` times one
step's rounding. The MoE model on masked samples exceeds that (one weight ends 1% outside the
bound after 3 steps, the same fp32 value at every layout that uses no TP): a layer-0
``v_proj`` element whose first gradient is within its rounding of 0 takes an fp32 first step
1e-4 from float64's (Adam's first step is a sign), and that moves the second step's gradients
by 12 times one step's rounding bound (the adam_steps_atol docstring).

Here step ``k`` of the float64 run starts from the weights ``w'_k`` the fp32 run started it
from (``publish_weights()``: every stage's tensors under the checkpoint's names, fp32, exact in
float64), and its Adam state is its own, accumulated from the gradients it computed at ``w'_0
.. w'_k``. The two steps then differ by that step's rounding only, at every step:

* loss: backend_reference.grpo_step's bound (``SCORE_ATOL`` per token; the ratio is 1);
* gradient norm: ``tolerances.step_norm_atol`` at step 0 (the gradients' own rounding);
* each trained token's log-prob and entropy: ``SCORE_ATOL`` (the same weights);
* the weights after the step, ``w'_(k+1)``: ``tolerances.adam_forced_step_atol`` around the
  float64 step's ``w'_k - lr u_k`` (the clip coefficient's error from
  ``tolerances.clip_rel_err``).

``w'_0`` is the checkpoint's, bit for bit (the test asserts it), so by induction a run that
passes every step is, step by step, a float64 HF + AdamW run but for each step's rounding; a
step wrong by more than that is caught at the step it happens (test_layouts.py's negative
checks: no update, the next step's weights, the weights off by a relative 1e-6, a gradient off
by 8 times its rounding bound).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
from backend_reference import (
    ADAM_EPS,
    BETAS,
    CLIP_GRAD,
    LR,
    grpo_advantages,
    grpo_step,
    load_reference_model,
    long_samples,
    record_adam,
    samples,
)
from safetensors.torch import save_file


def snapshot_params(model, hf_dir: str, weights: dict) -> list[torch.Tensor]:
    """``weights`` (checkpoint names, fp32 arrays or tensors) as float64 tensors in
    ``model.parameters()`` order, through the HF loader (which fuses MoE experts in memory as
    ``model`` holds them); every name must load, none may be left at its initialisation."""
    with tempfile.TemporaryDirectory() as d:
        for f in os.listdir(hf_dir):
            if f != "model.safetensors":
                shutil.copy(os.path.join(hf_dir, f), d)
        tensors = {k: torch.as_tensor(v).contiguous() for k, v in weights.items()}
        save_file(tensors, os.path.join(d, "model.safetensors"))
        loaded, info = type(model).from_pretrained(
            d,
            dtype=torch.float64,
            attn_implementation="eager",
            experts_implementation="eager",
            output_loading_info=True,
        )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return [p.detach().clone() for p in loaded.parameters()]


def forced_reference(hf_dir: str, snapshots: list[dict], long: bool = False, perturb=None):
    """Each step ``k`` of the layout suites' job (backend_reference.reference's math, one
    step per rollout on every sample) in float64 from ``snapshots[k]``, the fp32 run's weights
    before it (``len(snapshots) - 1`` steps; the last snapshot is the weights after the run),
    with the bounds of the module docstring. ``long``: on backend_reference.long_samples (else
    its masked samples). ``perturb(k, named_grads)``, if given, may change step ``k``'s float64
    gradients before clipping (negative checks).

    Returns ``steps`` and ``tol`` (per step ``loss`` and ``grad_norm``), ``scores`` (per step,
    per sample: backend_reference.token_scores at the same weights) and ``updates``: per step,
    per parameter name ``(start, got, want, tol)``: the fp32 weights before and after the step,
    the float64 step's weights after it and the bound on ``|got - want|``.
    """
    from tolerances import adam_forced_step_atol, clip_rel_err, step_norm_atol

    model = load_reference_model(hf_dir)
    names = [name for name, _ in model.named_parameters()]
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=ADAM_EPS, weight_decay=0.0)
    data = long_samples() if long else samples(masked=True)
    adv = grpo_advantages()
    history: list[list] = [[] for _ in params]
    clip_errs: list[float] = []
    out: dict = {"steps": [], "tol": [], "scores": [], "updates": []}
    starts = [snapshot_params(model, hf_dir, w) for w in snapshots]
    for k, (start, end) in enumerate(zip(starts, starts[1:])):
        with torch.no_grad():
            for p, w in zip(params, start, strict=True):
                p.copy_(w)
        opt.zero_grad()
        loss, loss_atol, scored = grpo_step(model, data, adv, None, True)
        loss.backward()
        if perturb is not None:
            perturb(k, {n: p.grad for n, p in zip(names, params)})
        grads = [p.grad.detach().clone() for p in params]
        norm = float(torch.nn.utils.clip_grad_norm_(params, CLIP_GRAD))
        clip_errs.append(clip_rel_err(grads, norm, CLIP_GRAD))
        opt.step()
        record_adam(history, opt, params, k)
        out["steps"].append({"loss": float(loss.detach()), "grad_norm": norm})
        out["tol"].append({"loss": loss_atol, "grad_norm": step_norm_atol(grads, 0)})
        out["scores"].append(scored)
        out["updates"].append(
            {
                name: (
                    w,
                    got,
                    p.detach().clone(),
                    adam_forced_step_atol(
                        h, w, lr=LR, betas=BETAS, eps=ADAM_EPS, clip_errs=clip_errs
                    ),
                )
                for name, p, h, w, got in zip(names, params, history, start, end, strict=True)
            }
        )
    return out


def check_updates(ref: dict, what: str) -> None:
    """Every step's weights after it within its bound of the float64 step's, element by
    element (:func:`forced_reference`'s ``updates``)."""
    from tolerances import assert_within

    for k, update in enumerate(ref["updates"]):
        for name, (_, got, want, tol) in update.items():
            assert_within(got, want, tol, f"{what}: step {k}: {name}")
