"""KL divergence estimators between the policy and a reference, per token.

With ``log_ratio = log pi(y) - log pi_ref(y)`` for a token ``y`` sampled from ``pi`` (Schulman,
"Approximating KL Divergence"):

* ``k1`` (alias ``kl``): ``log_ratio`` - unbiased, high variance, can be negative.
* ``k2``: ``log_ratio**2 / 2`` - biased, low variance, always >= 0.
* ``k3`` (alias ``low_var_kl``): ``exp(-log_ratio) - 1 + log_ratio`` - unbiased, >= 0; clamped
  to ``[-10, 10]`` so a single far-off token cannot dominate.

``--kl-loss-type`` selects the estimator for ``--use-kl-loss``; the in-reward penalty
(``--kl-coef``) uses the same function.
"""

from __future__ import annotations

import torch

KL_TYPES = ("k1", "kl", "k2", "k3", "low_var_kl")
K3_CLAMP = 10.0


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of ``kind`` (one of :data:`KL_TYPES`); see the module docstring."""
    log_ratio = log_probs.float() - ref_log_probs.float()
    if kind in ("k1", "kl"):
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):
        neg = -log_ratio
        return (neg.exp() - 1.0 - neg).clamp(-K3_CLAMP, K3_CLAMP)
    raise ValueError(f"--kl-loss-type must be one of {', '.join(KL_TYPES)}, got {kind!r}")


def reward_kl(batch, kind: str) -> list[torch.Tensor]:
    """``--kl-coef``'s per-sample, response-aligned KL: :func:`kl_estimate` of the policy's
    log-probs before this rollout's updates (``old_log_probs``) against the reference's
    (``ref_log_probs``), both fields of the :class:`~miles_core.batch.RolloutBatch`."""
    old = batch.response_field("old_log_probs")
    ref = batch.response_field("ref_log_probs")
    return [kl_estimate(o, r, kind) for o, r in zip(old, ref, strict=True)]
