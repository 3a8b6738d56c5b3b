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

Over several steps the fp32 run drifts from the float64 one, and step ``k``'s gradients are then
taken at different weights: a comparison of the weights after several steps from the checkpoint
alone would have to bound that drift's effect on the gradients (the loss's Hessian times the
weight differences, which nothing here bounds; on the tests' MoE model with masked samples one
first-step weight whose gradient is within its rounding of 0 takes a sign step 1e-4 from
float64's, and the second step's gradients move by 12 times their rounding bound). The tests
compare each step instead from the fp32 run's own weights (teacher forcing, tests/forced_adam.py):
every step is held to its own rounding and nothing compounds (:func:`adam_forced_step_atol`).
"""

from __future__ import annotations

import math

import torch

FP32_EPS = 2.0**-24
GRAD_REL_ERR = 2e-5
#: Bound on an fp32 log-prob or entropy of one token of the tests' tiny 2-layer models (64-wide
#: matmuls, a log-softmax over 96 tokens): a few hundred (256) roundings of ``FP32_EPS``
#: relative, each at a magnitude below 8 (``|log p|`` of such a model is about 5; the entropy is
#: at most ``log 96`` = 4.6), i.e. ``256 * 8 * 2^-24`` ~ 1.2e-4.
SCORE_ATOL = 256 * 8 * FP32_EPS


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


def step_norm_atol(grads: list[torch.Tensor], grad_rel_err: float = GRAD_REL_ERR) -> float:
    """Bound on the fp32 global gradient norm of one step against the reference's gradients
    ``grads`` (one tensor per parameter) taken at the same weights.

    Each element of tensor ``g_t`` is off by at most ``dg_t = grad_rel_err * max|g_t|``
    (:func:`grad_atol`), which moves ``||g||`` by at most ``sum_w |g_w| dg_w / ||g||`` (first
    order); the norm's own fp32 sum of squares adds ``log2(n) + 2`` roundings of ``||g||``
    (:func:`norm_atol`).
    """
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    dgs = [grad_rel_err * float(g.double().abs().max()) for g in grads]
    moved = sum(float(g.double().abs().sum()) * d for g, d in zip(grads, dgs)) / norm
    n = sum(g.numel() for g in grads)
    return moved + (math.log2(max(n, 1)) + 2) * FP32_EPS * norm


def adam_step_atol(
    grad: torch.Tensor,
    param: torch.Tensor,
    *,
    lr: float,
    eps: float,
    grad_rel_err: float = GRAD_REL_ERR,
) -> torch.Tensor:
    """Elementwise bound on ``|fp32 weight - reference weight|`` after one Adam(W) step from the
    checkpoint (several steps: :func:`adam_forced_step_atol`, each from the fp32 run's weights).

    ``grad`` is the reference gradient and ``param`` the reference weight after the step. The
    gradient's fp32 error ``dg = grad_rel_err * max|grad|`` moves the update ``g / (|g| +
    eps)`` by at most ``eps * dg / (|g| + eps)^2`` (never more than 2), times ``lr``, plus a
    few ulps for the update's own rounding, at the magnitude of the operands (the weight before
    the step, at most ``|param| + lr``).
    """
    g = grad.double().abs()
    dg = grad_rel_err * float(g.max()) if g.numel() else 0.0
    sensitivity = (eps * dg / (g + eps) ** 2).clamp(max=2.0)
    return lr * sensitivity + ulp_atol(param.double().abs() + lr)


def clip_rel_err(grads: list[torch.Tensor], norm: float, max_norm: float) -> float:
    """Bound on the relative error of the fp32 clip coefficient ``max_norm / (||g'|| + 1e-6)``
    (``clip_grad_norm_``) of a step whose float64 gradients ``grads`` (one tensor per
    parameter, before clipping) have norm ``norm`` and whose fp32 gradients are off by their
    own rounding only (the same weights): :func:`step_norm_atol`, relative, plus the
    addition's and the division's roundings. 0 where the norm is below ``max_norm`` (no
    clipping); a norm within its bound of ``max_norm`` could clip in one run and not the other,
    and raises."""
    atol = step_norm_atol(grads)
    if abs(norm - max_norm) <= atol:
        raise ValueError(f"gradient norm {norm} within its bound {atol} of the clip {max_norm}")
    return 0.0 if norm < max_norm else atol / norm + 2 * FP32_EPS


def clip_sides_agree(
    ref_log_ratio: torch.Tensor,
    run_log_ratio: torch.Tensor,
    edges: list[float],
    what: str,
    ulps: float = 64,
) -> None:
    """Raise where a clip edge of ``edges`` could lie between the float64 reference's
    importance ratio ``r = exp(ref_log_ratio)`` of a trained token and the fp32 run's ``r' =
    exp(run_log_ratio)`` (computed here from the values the run's loss read: its log-probs,
    its old ones; its own fp32 ratio is within ``ulps FP32_EPS r'`` of that, the subtraction's,
    a mean over a sample's tokens' and the exponential's roundings). Where ``r`` and ``r'`` lie
    on different sides of an edge, or ``r'`` within that of it, one run may clip the token and
    the other not, which switches its gradient term on or off: no rounding bound covers that
    (as :func:`clip_rel_err` for the gradient norm). Elsewhere both runs clip the same tokens.
    Where both ratios come from the same inputs (a TIS weight from the run's old log-probs and
    the engine's), pass the same log-ratio twice."""
    r, rp = ref_log_ratio.double().exp(), run_log_ratio.double().exp()
    atol = ulps * FP32_EPS * rp
    for edge in edges:
        near = ((r - edge) * (rp - edge) <= 0) | ((rp - edge).abs() <= atol)
        if bool(near.any()):
            i = int(near.nonzero()[0, 0])
            raise ValueError(f"{what}: ratios {float(r[i])}, {float(rp[i])} at the clip {edge}")


def adam_forced_step_atol(
    steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    before: torch.Tensor,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    clip_errs: list[float],
    weight_decay: float = 0.0,
    grad_rel_err: float = GRAD_REL_ERR,
) -> torch.Tensor:
    """Elementwise bound on ``|w'_(k+1) - w_(k+1)|`` for Adam(W) step ``k = len(steps) - 1``
    at learning rate ``lr`` (this step's) when the float64 reference takes the step from the
    fp32 run's own weights ``before = w'_k`` (teacher forcing, tests/forced_adam.py) with its
    own Adam state, accumulated from gradients it too took at the fp32 run's weights of each
    step. ``steps`` holds, per step ``j <= k``, the reference's clipped gradient ``G_j``,
    bias-corrected Adam denominator ``d_j = sqrt(v_hat_j) + eps`` and update direction ``u_j =
    m_hat_j / d_j``; ``clip_errs`` the clip coefficient's relative error ``rho_j`` per step
    (:func:`clip_rel_err`; 0 without clipping).

    Both runs compute every gradient from the same weights (and from the same inputs the fp32
    run computed before the step: with several steps a rollout, its old policy's and reference
    model's log-probs, which the tests hold to float64 on their own), so they differ by its
    rounding only, whatever step it is: ``|G'_j - G_j| <= E_j + rho_j |G_j|`` with ``E_j =
    grad_rel_err max|G_j|`` (the tensor's, :func:`grad_atol`; where the importance ratio is not
    1 its rounding is the forward's, one factor of each token's term, and both runs clip the
    same tokens: :func:`clip_sides_agree`) and ``rho_j`` the clip coefficient's share. Step ``k``'s bias-corrected moments are weighted means of the
    gradients so far, ``m = sum_j a_j G_j`` and ``v = sum_j c_j G_j^2`` with ``a_j = (1 - b1)
    b1^(k - j) / (1 - b1^(k + 1))`` and ``c_j`` likewise with ``b2`` (each set summing to 1),
    ``d = sqrt(v) + eps``, ``u = m / d``; with ``E = max_j E_j`` and ``rho = max_j rho_j``:

    * ``|dm| <= E + rho sum_j a_j |G_j|``;
    * ``|d sqrt(v)| <= E + rho sqrt(v)`` (``sqrt(v)`` is a ``c``-weighted L2 norm of the
      ``G_j``: Minkowski's inequality);
    * ``|du| <= (|dm| + |u| |d sqrt(v)|) / d = (E (1 + |u|) + rho (sum_j a_j |G_j| + |u|
      sqrt(v))) / d``; at the first step ``u = G / (|G| + eps)`` ignores a common factor on
      ``G`` but for ``eps``: the clip's term is ``rho |u| eps / d`` there;
    * ``|u| <= U_k = sqrt(sum_j a_j^2 / c_j)`` in both runs (Cauchy-Schwarz: 1 at the first
      step, 1.0015 at the second for 0.9 / 0.999), so ``|du| <= 2 U_k``;
    * an element whose float64 gradient is exactly 0 at every step so far is one no token
      reaches (an embedding row of a token absent from the steps): its fp32 gradient is exactly
      0 as well, its update is 0 in both runs.

    The weights move by ``lr du``, plus 8 ulps of ``|w'_k| + lr`` for the update's and the
    subtraction's roundings (and the fp32 Adam state's own, a few ``FP32_EPS`` of ``max|G|`` a
    step, within the slack of ``GRAD_REL_ERR``: 1.5e-5 rounded up to 2e-5); decoupled weight
    decay ``w'_k (1 - lr weight_decay)`` is computed from the same weights in both runs and
    adds its factor's and its product's roundings, 2 ulps of ``|w'_k|``. Nothing grows with
    ``k``: the weight differences of the steps before are where both runs start this one, not
    an error of it, so every step is held to one step's rounding.
    """
    k = len(steps) - 1
    b1, b2 = betas
    a = [(1 - b1) * b1 ** (k - j) / (1 - b1 ** (k + 1)) for j in range(k + 1)]
    c = [(1 - b2) * b2 ** (k - j) / (1 - b2 ** (k + 1)) for j in range(k + 1)]
    cap = 2 * lr * sum(x * x / y for x, y in zip(a, c)) ** 0.5
    grads = [g.double() for g, _, _ in steps]
    big_e = max(grad_rel_err * float(g.abs().max()) for g in grads)
    rho = max(clip_errs)
    _, denom, update = steps[-1]
    d, u = denom.double(), update.double().abs()
    if k == 0:
        clip = rho * u * eps / d
    else:
        clip = rho * (sum(w * g.abs() for w, g in zip(a, grads)) + u * (d - eps)) / d
    term = (lr * (big_e * (1 + u) / d + clip)).clamp(max=cap)
    untouched = torch.stack([g == 0 for g in grads]).all(0)
    rounding = ulp_atol(before.double().abs() + lr)
    if weight_decay:
        rounding = rounding + ulp_atol(before, 2)
    return torch.where(untouched, 0.0, term) + rounding


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


# ---- batch-invariant kernels (miles_native.kernels.batch_invariant) ---------------------------
#: Unit roundoff of each dtype a kernel stores its result in (half the gap between 1 and the next
#: number): fp32 24 significant bits, bf16 8, fp16 11. A result rounded once to the output dtype
#: is within this, relative, of the fp32 value it was rounded from.
UNIT_ROUNDOFF = {torch.float32: FP32_EPS, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def dot_atol(reference: torch.Tensor, abs_products: torch.Tensor, k: int, dtype) -> torch.Tensor:
    """A sum of ``k`` products of ``dtype`` inputs (exact in fp32), accumulated in fp32 and
    rounded once to ``dtype``: ``k`` fp32 roundings of partial sums bounded by
    ``abs_products = sum |x_i w_i|``, plus the final rounding of ``|reference|``."""
    return k * FP32_EPS * abs_products.double() + UNIT_ROUNDOFF[dtype] * reference.double().abs()


def attention_atol(reference, scores_abs, n_keys: int, v_max: float, dim: int, dtype):
    """One query's softmax-weighted sum of ``n_keys`` value rows in fp32, rounded to ``dtype``.

    Each score is a ``dim``-term fp32 dot (``dim`` roundings of partial sums bounded by
    ``scores_abs``, the largest ``scale * sum |q_d k_d|``, and the scaling): an error ``ds``
    moves the probabilities by at most ``2 ds`` in l1, so the output by ``2 ds * v_max``. The
    weighted sum adds ``n_keys`` roundings of terms bounded by ``v_max``; the exponentials, the
    running rescales and the final division a few more (8). With 16-bit inputs the weights are
    rounded to ``dtype`` for the weighted sum's dot (as flash attention does): each moves by at
    most its own unit roundoff relative, the output by ``UNIT_ROUNDOFF * v_max``.
    """
    ds = (dim + 2) * FP32_EPS * scores_abs
    fp32 = (2 * ds + (n_keys + 8) * FP32_EPS) * v_max
    weights = 0.0 if dtype == torch.float32 else UNIT_ROUNDOFF[dtype] * v_max
    return fp32 + weights + UNIT_ROUNDOFF[dtype] * reference.double().abs()


def row_mean_atol(reference: torch.Tensor, abs_mean: torch.Tensor, n: int, dtype) -> torch.Tensor:
    """A mean of ``n`` values summed in fp32 (``n`` roundings bounded by ``n * abs_mean``, i.e.
    ``n * FP32_EPS * abs_mean`` after the division, which rounds once more), then ``dtype``."""
    fp32 = (n + 1) * FP32_EPS * abs_mean.double()
    return fp32 + UNIT_ROUNDOFF[dtype] * reference.double().abs()


def log_softmax_atol(reference: torch.Tensor, scaled: torch.Tensor, n: int) -> torch.Tensor:
    """fp32 ``z - log sum exp z`` over ``n`` entries (``z = x / T``, rounded once): the sum of
    ``n`` exponentials in ``(0, 1]`` is off by ``(n + 4) FP32_EPS`` relative (its additions and
    each exponential's rounding), hence its log by that absolute; ``z``, the log's own rounding
    and the subtraction each add one rounding of a term bounded by ``|z| + |reference|``."""
    return FP32_EPS * ((n + 4) + 3 * (scaled.double().abs() + reference.double().abs()))
