"""Test support: the float64 HF + AdamW reference of backend_reference's GRPO job (one optimizer
step per rollout, on every sample), stepped from the fp32 run's own weights (teacher forcing,
tests/forced_adam.py), so that each optimizer step is held to one step's rounding: the layout
suites (test_layouts.py), test_backend.py and, on a GPU node, tests/gpu/test_megatron_gpu.py.

Step ``k`` of the float64 run starts from the weights ``w'_k`` the fp32 run started it from
(``publish_weights()`` or ``hf_weights()``: every stage's tensors under the checkpoint's names,
fp32, exact in float64), and its Adam state is its own, accumulated from the gradients it
computed at ``w'_0 .. w'_k``. The two steps then differ by that step's rounding only, at every
step:

* loss: backend_reference.grpo_step's bound (``SCORE_ATOL`` per token; the ratio is 1);
* gradient norm: ``tolerances.step_norm_atol`` (the gradients' own rounding);
* each trained token's log-prob and entropy: ``SCORE_ATOL`` (the same weights);
* the weights after the step, ``w'_(k+1)``: ``tolerances.adam_forced_step_atol`` around the
  float64 step's ``w'_k - lr u_k`` (the clip coefficient's error from
  ``tolerances.clip_rel_err``).

``w'_0`` is the checkpoint's, bit for bit (:func:`check_forced` asserts it), so by induction a
run that passes every step is, step by step, a float64 HF + AdamW run but for each step's
rounding; a step wrong by more than that is caught at the step it happens (test_layouts.py's
negative checks: no update, the next step's weights, the weights off by a relative 1e-6, a
gradient off by 8 times its rounding bound).
"""

from __future__ import annotations

import numpy as np
import torch
from backend_reference import (
    ADAM_EPS,
    BETAS,
    CLIP_GRAD,
    LR,
    check_steps,
    grpo_advantages,
    grpo_step,
    load_reference_model,
    long_samples,
    samples,
)
from forced_adam import ForcedAdam, check_updates, snapshot_params


def forced_reference(
    hf_dir: str, snapshots: list[dict], long: bool = False, perturb=None, device: str = "cpu"
):
    """Each step ``k`` of the job (backend_reference's math) in float64 on ``device`` from
    ``snapshots[k]``, the fp32 run's weights before it (``len(snapshots) - 1`` steps; the last
    snapshot is the weights after the run), with the bounds of the module docstring. ``long``:
    on backend_reference.long_samples (else its masked samples). ``perturb(k, named_grads)``,
    if given, may change step ``k``'s float64 gradients before clipping (negative checks).

    Returns ``steps`` and ``tol`` (per step ``loss`` and ``grad_norm``), ``scores`` (per step,
    per sample: backend_reference.token_scores at the same weights) and ``updates``: per step,
    per parameter name ``(start, got, want, tol)`` (forced_adam.ForcedAdam.step).
    """
    model = load_reference_model(hf_dir, device)
    adam = ForcedAdam(model, betas=BETAS, eps=ADAM_EPS, clip_grad=CLIP_GRAD)
    data = long_samples() if long else samples(masked=True)
    adv = grpo_advantages()
    out: dict = {"steps": [], "tol": [], "scores": [], "updates": []}
    starts = [snapshot_params(model, hf_dir, w) for w in snapshots]
    for k, (start, end) in enumerate(zip(starts, starts[1:])):
        adam.begin(start)
        loss, loss_atol, scored = grpo_step(model, data, adv, True, device)
        loss.backward()
        step = adam.step(LR, end, None if perturb is None else lambda g, k=k: perturb(k, g))
        out["steps"].append({"loss": float(loss.detach()), "grad_norm": step["grad_norm"]})
        out["tol"].append({"loss": loss_atol, "grad_norm": step["grad_norm_tol"]})
        out["scores"].append(scored)
        out["updates"].append(step["updates"])
    return out


def check_forced(
    ranks: list[dict],
    hf_dir: str,
    starts: list[dict],
    final: dict,
    what: str,
    long: bool = False,
    device: str = "cpu",
    every_rank: bool = True,
) -> dict:
    """One run (every rank's result: ``metrics`` and ``scores`` per rollout, one optimizer step
    each) against :func:`forced_reference` from its own weights (``starts``, one per rollout,
    then ``final``): the first step starts from the checkpoint bit for bit; each rollout's loss
    and gradient norm, each step's scores at every trained token (every loss mask with a hole)
    and weights after it (the metrics of every rank, or with ``every_rank`` False rank 0's);
    returns the reference."""
    from safetensors.torch import load_file
    from score_capture import check_scores

    base = load_file(f"{hf_dir}/model.safetensors")
    assert sorted(starts[0]) == sorted(base) == sorted(final), what
    first = {k: torch.as_tensor(v).cpu().numpy() for k, v in starts[0].items()}
    assert all(np.array_equal(first[k], base[k].numpy()) for k in base), what
    ref = forced_reference(hf_dir, [*starts, final], long=long, device=device)
    for rank, r in enumerate(ranks if every_rank else ranks[:1]):
        check_steps(r["metrics"], ref, f"{what} rank {rank}")
    check_updates(ref["updates"], what)
    data = long_samples() if long else samples(masked=True)
    check_scores(ranks, ref, data, what, holes=True)
    return ref
