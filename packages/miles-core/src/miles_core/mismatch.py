"""The train/rollout mismatch: how far the trainer's log-probs of the sampled tokens are from
the log-probs the engine sampled them with.

The two sides compute the same policy with different kernels, batch shapes and dtypes, so they
disagree a little on every token; when they disagree a lot, the policy gradient is biased (the
samples are off-policy) and importance sampling (``--use-tis``) or a fix on the serving side is
needed. Every rollout whose samples carry the engine's log-probs reports, over the trained
tokens (loss mask 1), at no extra forward (the trainer's side is the old-policy log-prob the
loss already has):

- ``train_rollout_logprob_abs_diff``: mean ``|log pi_train - log pi_rollout|`` (the name
  radixark/miles gives it, so runs compare across the two);
- ``train_rollout_k3_kl``: the K3 estimate of ``KL(pi_rollout || pi_train)`` from tokens
  sampled by the engine, ``r - 1 - log r`` with ``r = pi_train / pi_rollout`` (>= 0, 0 only
  where the two agree);
- ``train_rollout_is_ratio_mean`` and ``train_rollout_is_ratio_std``: the importance ratio
  ``r`` (what ``--use-tis`` clips), its mean and standard deviation;
- ``train_rollout_logprob_abs_diff_gt_{THRESHOLD}``: the fraction of tokens whose
  ``|log r|`` exceeds :data:`THRESHOLD` (``r`` outside about ``[0.82, 1.22]``);
- ``train_rollout_logprob_abs_diff_max``, ``train_rollout_is_ratio_min`` and
  ``train_rollout_is_ratio_max``: the extremes over every trained token of the rollout (all
  its optimizer steps);
- ``train_rollout_logprob_abs_diff_sample_max`` and ``train_rollout_k3_kl_sample_max``: the
  worst sample's mean over its own trained tokens (a sample without trained tokens counts
  0). One broken sample (a wrong prompt template, a truncated chat, an engine that sampled
  it from other weights) stands out here while the rollout's means barely move; a token
  maximum far above the worst sample's mean points at isolated tokens instead (a kernel's
  rare outlier).

The means are the loss's masked means (:func:`miles_core.losses.compute_policy_loss`'s
metrics: the same aggregation as ``ppo_kl``), summed over micro-batches and data-parallel ranks
and averaged over a rollout's optimizer steps like every loss metric; the standard deviation is
formed from the means of ``r`` and ``r**2`` by :func:`finish`. The extremes combine by maximum
and minimum, and each sample's mean is summed over the context-parallel ranks that hold parts of
it before the worst is taken (:mod:`miles_core.metric_reduction`).
"""

from __future__ import annotations

import math

import torch

from miles_core.aggregation import segment_sum
from miles_core.metric_reduction import masked_max, masked_min

ABS_DIFF = "train_rollout_logprob_abs_diff"
K3_KL = "train_rollout_k3_kl"
RATIO_MEAN = "train_rollout_is_ratio_mean"
RATIO_STD = "train_rollout_is_ratio_std"
#: |log r| above which a token counts as mismatched.
THRESHOLD = 0.2
PAST_THRESHOLD = f"train_rollout_logprob_abs_diff_gt_{THRESHOLD}"
ABS_DIFF_MAX = "train_rollout_logprob_abs_diff_max"
RATIO_MIN = "train_rollout_is_ratio_min"
RATIO_MAX = "train_rollout_is_ratio_max"
ABS_DIFF_SAMPLE_MAX = "train_rollout_logprob_abs_diff_sample_max"
K3_SAMPLE_MAX = "train_rollout_k3_kl_sample_max"
_RATIO_SQ = "_train_rollout_is_ratio_sq_mean"  # intermediate: gone after :func:`finish`
#: The log-ratio is clamped to +-LOG_CLAMP before ``exp`` (as the importance weights are).
LOG_CLAMP = 20.0


def token_terms(
    train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per-token values whose masked means are the metrics (no gradient)."""
    log_ratio = (train_log_probs - rollout_log_probs).detach()
    clamped = log_ratio.clamp(-LOG_CLAMP, LOG_CLAMP)
    ratio = clamped.exp()
    return {
        ABS_DIFF: log_ratio.abs(),
        K3_KL: ratio - 1.0 - clamped,
        RATIO_MEAN: ratio,
        _RATIO_SQ: ratio * ratio,
        PAST_THRESHOLD: (log_ratio.abs() > THRESHOLD).to(log_ratio.dtype),
    }


def extremes(
    terms: dict[str, torch.Tensor],
    loss_mask: torch.Tensor,
    sample_ids: torch.Tensor | None = None,
    num_samples: int | None = None,
    sample_loss_tokens: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The extremes of one micro-batch from its :func:`token_terms`: the token maximum and
    minimum over the trained tokens, and with ``sample_ids`` (-1 on padding) and
    ``num_samples`` each sample's share of its mean ``(1 / n_i) sum_t m_t x_t`` (``n_i``:
    ``sample_loss_tokens``, the whole sample's trained tokens, else counted here), which
    :class:`~miles_core.metric_reduction.StepMetrics` turns into the worst sample's."""
    out = {
        ABS_DIFF_MAX: masked_max(terms[ABS_DIFF], loss_mask),
        RATIO_MIN: masked_min(terms[RATIO_MEAN], loss_mask),
        RATIO_MAX: masked_max(terms[RATIO_MEAN], loss_mask),
    }
    if sample_ids is None or num_samples is None:
        return out
    keep = loss_mask.reshape(-1).to(terms[ABS_DIFF].device) > 0
    if sample_loss_tokens is None:
        sample_loss_tokens = segment_sum(keep.float(), sample_ids, num_samples)
    counts = sample_loss_tokens.to(keep.device, terms[ABS_DIFF].dtype).clamp(min=1)
    for name, term in ((ABS_DIFF_SAMPLE_MAX, ABS_DIFF), (K3_SAMPLE_MAX, K3_KL)):
        values = terms[term].reshape(-1)
        kept = torch.where(keep, values, torch.zeros_like(values))
        out[name] = segment_sum(kept, sample_ids, num_samples) / counts
    return out


def finish(metrics: dict[str, float]) -> dict[str, float]:
    """The ratio's standard deviation from the means of ``r`` and ``r**2`` (a rollout's
    aggregated metrics, in place); the intermediate mean of ``r**2`` is removed."""
    sq = metrics.pop(_RATIO_SQ, None)
    if sq is not None and RATIO_MEAN in metrics:
        metrics[RATIO_STD] = math.sqrt(max(sq - metrics[RATIO_MEAN] ** 2, 0.0))
    return metrics
