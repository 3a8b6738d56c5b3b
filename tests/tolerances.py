"""Tolerances derived from the arithmetic, for tests that compare fp32 training to a reference.

A numeric test compares what our code computes in fp32 with a reference written in the test
(usually float64). The allowed difference comes from how fp32 rounding propagates through the
operations involved, not from what one machine happened to give: another CPU kernel path
(AVX2, AVX-512, or ATen's ``default`` one; CI runs the numeric tests under both) rounds
differently, and a bound that was read off one machine fails on the next.

``FP32_EPS`` is fp32's unit roundoff (2^-24). A gradient is a sum over tokens of products along the
backward chain; its fp32 rounding error is bounded, relative to the tensor's largest gradient, by
``GRAD_REL_ERR``: a few hundred roundings (reductions of ~100 token contributions through a
2-layer model's backward), i.e. ~2^-24 * 256 ~ 1.5e-5, rounded up to 2e-5.

Adam turns gradient rounding into lr-sized differences: at step 1 its update is
``lr * g / (|g| + eps)``, whose derivative in ``g`` is ``lr * eps / (|g| + eps)^2``; an element whose
gradient is within a few ``eps`` of zero can flip its update by up to ``2 * lr`` for a last-bit
difference in ``g``. :func:`adam_step_atol` gives that bound element by element, so elements with
ordinary gradients are still held to fp32 rounding.
"""

from __future__ import annotations

import math

import torch

FP32_EPS = 2.0**-24
GRAD_REL_ERR = 2e-5

#: Two fp32 computations of one forward or backward whose kernels order or fuse the operations
#: differently (``--compile-decoder-layers``' inductor kernels against the eager ones): each lies
#: within ``GRAD_REL_ERR`` of the exact value, relative to its tensor's scale (the derivation
#: above holds for a forward as for a backward: a few hundred roundings through a 2-layer model),
#: so the two differ by at most the sum of both bounds.
REORDERED_REL_ERR = 2 * GRAD_REL_ERR


def ulp_atol(reference: torch.Tensor, ulps: float = 8) -> torch.Tensor:
    """``ulps`` units in the last place of fp32 at each element's magnitude."""
    return ulps * FP32_EPS * reference.double().abs().clamp_min(torch.finfo(torch.float32).tiny)


def grad_atol(reference: torch.Tensor, grad_rel_err: float = GRAD_REL_ERR) -> torch.Tensor:
    """Bound on an fp32 gradient's error: ``grad_rel_err`` times the tensor's largest gradient.

    A gradient element is a sum of many signed terms; its rounding error scales with the size of
    those terms (bounded by the tensor's largest gradient), not with the element itself, which
    cancellation can make arbitrarily small: an ``rtol`` on the element is not a bound.
    """
    scale = float(reference.double().abs().max()) if reference.numel() else 0.0
    return torch.full_like(reference, grad_rel_err * scale, dtype=torch.float64)


def norm_atol(grads: list[torch.Tensor], grad_rel_err: float = GRAD_REL_ERR) -> float:
    """Bound on ``| ||g'|| - ||g|| |`` (the global gradient norm) when each element of each
    tensor ``g_t`` of ``grads`` is off by at most ``grad_rel_err * max|g_t|`` (:func:`grad_atol`).

    By the triangle inequality the norms differ by at most ``||g' - g||``, at most
    ``sqrt(sum_t n_t (grad_rel_err max|g_t|)^2)``; each norm's own fp32 sum of squares adds
    ``log2(n) + 2`` roundings (a blocked, pairwise sum) relative to the norm, for each of the two.
    """
    square = sum(t.numel() * (grad_rel_err * float(t.double().abs().max())) ** 2 for t in grads)
    norm = math.sqrt(sum(float(t.double().square().sum()) for t in grads))
    n = sum(t.numel() for t in grads)
    return math.sqrt(square) + 2 * (math.log2(max(n, 1)) + 2) * FP32_EPS * norm


def adam_step_atol(
    grad: torch.Tensor,
    param: torch.Tensor,
    *,
    lr: float,
    eps: float,
    steps: int = 1,
    grad_rel_err: float = GRAD_REL_ERR,
) -> torch.Tensor:
    """Elementwise bound on ``|fp32 weight - reference weight|`` after ``steps`` Adam(W) steps.

    ``grad`` is the reference gradient of the first step and ``param`` the reference weight.
    The gradient's fp32 error ``dg = grad_rel_err * max|grad|`` moves the step-1 update
    ``g / (|g| + eps)`` by at most ``eps * dg / (|g| + eps)^2`` (never more than 2); each step
    adds at most that times ``lr``, plus a few ulps for the update's own rounding, at the
    magnitude of the operands (the weight before the step, at most ``|param| + lr`` a step).
    """
    g = grad.double().abs()
    dg = grad_rel_err * float(g.max()) if g.numel() else 0.0
    sensitivity = (eps * dg / (g + eps) ** 2).clamp(max=2.0)
    return steps * (lr * sensitivity + ulp_atol(param.double().abs() + steps * lr))


def adam_steps_atol(
    steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    param: torch.Tensor,
    *,
    lr: float,
    grad_rel_err: float = GRAD_REL_ERR,
) -> torch.Tensor:
    """Elementwise bound on ``|fp32 weight - reference weight|`` after several Adam(W) steps
    whose gradients differ step to step (several optimizer steps per rollout).

    ``steps`` holds, per step ``k``, the reference's gradient ``g_k``, its bias-corrected Adam
    denominator ``d_k = sqrt(v_hat_k) + eps`` and update direction ``u_k = m_hat_k / d_k``.
    ``m_hat`` and ``sqrt(v_hat)`` are weighted means (an L1 and an L2 one, weights summing to 1)
    of the gradients so far, so a gradient error of at most ``dg`` moves each by at most ``dg``
    and ``u_k`` by at most ``dg * (1 + |u_k|) / d_k``. Step ``k``'s gradient also carries the
    weight differences of the steps before it: its ``dg`` is taken as ``(k + 1) *
    grad_rel_err * max|g_k|``. Plus :func:`ulp_atol` for each update's own rounding.
    """
    atol = torch.zeros_like(param, dtype=torch.float64)
    for k, (grad, denom, update) in enumerate(steps):
        dg = (k + 1) * grad_rel_err * float(grad.double().abs().max())
        atol += lr * dg * (1 + update.double().abs()) / denom.double()
    return atol + len(steps) * ulp_atol(param.double().abs() + len(steps) * lr)


def assert_within(got: torch.Tensor, want: torch.Tensor, atol: torch.Tensor, what: str) -> None:
    """``|got - want| <= atol`` element by element, reporting the worst element if not."""
    diff = (got.double() - want.double()).abs()
    excess = diff - atol.double()
    if bool((excess > 0).any()):
        worst = int(excess.argmax())
        raise AssertionError(
            f"{what}: {int((excess > 0).sum())} of {diff.numel()} elements outside the bound; "
            f"worst at {worst}: |{float(got.flatten()[worst]):.9g} - "
            f"{float(want.flatten()[worst]):.9g}| = {float(diff.flatten()[worst]):.3g} "
            f"> {float(atol.flatten()[worst]):.3g}"
        )
