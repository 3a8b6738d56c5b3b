"""Test support: a float64 HF model and torch AdamW taking each optimizer step of an fp32 run from
the weights that run had before it (teacher forcing), with the bounds tests/tolerances.py
derives for one step.

A test that holds the weights after several optimizer steps to float64 compares each step on its
own: float64 step ``k`` starts from the fp32 run's weights ``w'_k`` (fp32 values, exact in
float64; ``w'_0`` is the checkpoint's, bit for bit), and its Adam state is its own, accumulated
from the gradients it computed at ``w'_0 .. w'_k``. The two steps then differ by that step's
rounding only, at every step (``tolerances.adam_forced_step_atol``; the gradient norm:
``tolerances.step_norm_atol``; the clip coefficient: ``tolerances.clip_rel_err``). No bound has
to cover how far an fp32 run drifts from a float64 one over several steps, which the
arithmetic does not bound (the tolerances module docstring). By induction a run that passes
every step is, step by step, a float64 run but for each step's rounding; a step wrong by more
than that is caught at the step it happens (:func:`assert_wrong_steps_caught`).

Used by tests/miles_megatron/forced_reference.py (the layout suites, test_backend.py and
tests/gpu/test_megatron_gpu.py), tests/miles_megatron/estimator_reference.py (the estimator
and pairwise suites) and tests/miles_fsdp/test_step_slices.py.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch


def snapshot_params(model, hf_dir: str, weights: dict) -> list[torch.Tensor]:
    """``weights`` (checkpoint names, fp32 arrays or tensors) as float64 CPU tensors in
    ``model.parameters()`` order, through the HF loader (which fuses MoE experts in memory as
    ``model`` holds them); every name must load, none may be left at its initialisation."""
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as d:
        for f in os.listdir(hf_dir):
            if f != "model.safetensors":
                shutil.copy(os.path.join(hf_dir, f), d)
        tensors = {k: torch.as_tensor(v).detach().cpu().contiguous() for k, v in weights.items()}
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


class ForcedAdam:
    """torch AdamW (float64) over ``model``'s parameters, each step taken from given weights.

    Per step: :meth:`begin` with the fp32 run's weights before it, the caller's forward and
    ``backward()`` of the step's loss, then :meth:`step` with the step's LR and the fp32 run's
    weights after it. ``clip_grad``: ``clip_grad_norm_``'s max norm (``None``: no clipping).
    """

    def __init__(self, model, *, betas, eps: float, weight_decay: float = 0.0, clip_grad=None):
        self.names = [name for name, _ in model.named_parameters()]
        self.params = list(model.parameters())
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.clip_grad = clip_grad
        self.opt = torch.optim.AdamW(
            self.params, lr=0.0, betas=betas, eps=eps, weight_decay=weight_decay
        )
        self.history: list[list] = [[] for _ in self.params]
        self.clip_errs: list[float] = []
        self.start: list[torch.Tensor] = []

    def begin(self, weights: list[torch.Tensor]) -> None:
        """The model's parameters set to ``weights`` (float64, parameter order), gradients 0."""
        with torch.no_grad():
            for p, w in zip(self.params, weights, strict=True):
                p.copy_(w)
        self.start = [w.detach().cpu() for w in weights]
        self.opt.zero_grad()

    def step(self, lr: float, after: list[torch.Tensor], perturb=None) -> dict:
        """After the backward of the step's loss: ``perturb(named_grads)`` if given (negative
        checks may change the float64 gradients), the gradient norm before clipping and the
        clip, one AdamW step at ``lr``. Returns ``grad_norm``, its bound ``grad_norm_tol`` and
        ``updates``: per parameter name ``(start, got, want, tol)``, the fp32 weights before and
        after (``after``, parameter order) the step, the float64 step's weights after it and
        the bound on ``|got - want|`` (CPU tensors)."""
        from tolerances import adam_forced_step_atol, clip_rel_err, step_norm_atol

        if perturb is not None:
            perturb({n: p.grad for n, p in zip(self.names, self.params)})
        grads = [p.grad.detach().clone() for p in self.params]
        if self.clip_grad:
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.clip_grad))
            self.clip_errs.append(clip_rel_err(grads, norm, self.clip_grad))
        else:
            norm = float(torch.stack([g.norm() for g in grads]).norm())
            self.clip_errs.append(0.0)
        self.opt.param_groups[0]["lr"] = lr
        self.opt.step()
        k = len(self.clip_errs) - 1
        b1, b2 = self.betas
        for h, p in zip(self.history, self.params):  # what adam_forced_step_atol reads
            state = self.opt.state[p]
            denom = (state["exp_avg_sq"] / (1 - b2 ** (k + 1))).sqrt() + self.eps
            h.append(
                (p.grad.detach().clone(), denom, state["exp_avg"] / (1 - b1 ** (k + 1)) / denom)
            )
        updates = {}
        for name, p, h, w, got in zip(
            self.names, self.params, self.history, self.start, after, strict=True
        ):
            tol = adam_forced_step_atol(
                h,
                w.to(p.device),
                lr=lr,
                betas=self.betas,
                eps=self.eps,
                clip_errs=self.clip_errs,
                weight_decay=self.weight_decay,
            )
            updates[name] = (w, torch.as_tensor(got), p.detach().cpu().clone(), tol.cpu())
        return {"grad_norm": norm, "grad_norm_tol": step_norm_atol(grads), "updates": updates}


def check_updates(updates: list[dict], what: str) -> None:
    """Every step's weights after it within its bound of the float64 step's, element by
    element (``updates``: per step, :meth:`ForcedAdam.step`'s)."""
    from tolerances import assert_within

    for k, update in enumerate(updates):
        for name, (_, got, want, tol) in update.items():
            assert_within(got, want, tol, f"{what}: step {k}: {name}")


def worst_ratio(updates: list[dict]) -> float:
    """``max |got - want| / tol`` over every step and element (the share of its bound a run
    uses: 1 is the bound)."""
    worst = 0.0
    for update in updates:
        for _, got, want, tol in update.values():
            ratio = (got.double() - want.double()).abs() / tol.double().clamp_min(1e-300)
            worst = max(worst, float(ratio.max()))
    return worst


def assert_wrong_steps_caught(updates: list[dict], what: str) -> None:
    """Each step's bound tells a wrong step from the right one: a step that moved no weight
    (the weights it started from), the weights after it off by a relative 1e-6 (about 17
    ulps) and, but for the last step, the next step's weights each fail :func:`check_updates`'
    comparison with the float64 step."""
    from tolerances import assert_within

    for k, update in enumerate(updates):
        wrongs = {
            "no step": {name: start for name, (start, _, _, _) in update.items()},
            "1e-6 off": {name: got * (1 + 1e-6) for name, (_, got, _, _) in update.items()},
        }
        if k + 1 < len(updates):  # the next step's weights
            wrongs["shift"] = {name: u[1] for name, u in updates[k + 1].items()}
        for why, weights in wrongs.items():
            with pytest.raises(AssertionError, match="outside the bound"):
                for name, (_, _, want, tol) in update.items():
                    assert_within(weights[name], want, tol, f"{what} step {k}: {why}")


def caught_steps(updates: list[dict], tensor: str) -> list[int]:
    """The steps at which ``tensor``'s weights after the step leave their bound."""
    return [
        k
        for k, update in enumerate(updates)
        if bool(((update[tensor][1] - update[tensor][2]).abs() > update[tensor][3]).any())
    ]
