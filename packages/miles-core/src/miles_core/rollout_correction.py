"""Importance sampling and rejection against the engine's log-probs (``--use-tis``): the
weights that correct the policy gradient for the train/rollout mismatch
(:mod:`miles_core.mismatch` measures it).

With ``d_t = log pi_old(t) - log pi_rollout(t)`` (no gradient) over a sample's trained tokens
(loss mask 1), the log-weight of token ``t`` of sample ``i`` is, by ``--tis-level``:

- ``token``: ``d_t`` (truncated IS: Yao et al., "Your efficient RL framework secretly brings
  you off-policy RL training", 2025);
- ``sequence``: ``sum_t d_t`` over the sample, the same for all its tokens (the sequence's
  likelihood ratio);
- ``geometric``: ``(1/n_i) sum_t d_t``, the geometric mean of the token ratios.

``w = exp(clamp(log-weight, +-20))`` is then, by ``--tis-mode``:

- ``truncate``: ``clamp(w, tis_clip_low, tis_clip)``;
- ``mask``: ``w`` where ``tis_clip_low <= w <= tis_clip``, else 0 (the token, or at the
  sequence levels the whole sample, is rejected).

``--tis-veto-threshold V``: a sample with any trained token whose own ratio ``exp(d_t)`` is
below ``V`` gets weight 0 on every token (a token the trainer finds far less likely than the
engine did signals a broken sample). The weights multiply the per-token policy-gradient loss;
the metrics are their mean (``tis``), the fraction of tokens whose weight the truncation or the
mask changed (``tis_clipfrac``) and the fraction vetoed (``tis_veto_frac``).

``--tis-batch-normalize``: the weights, as they enter the loss (after the truncation or mask and
the veto), are divided by their mean over the optimizer step's trained tokens (``token``
level) or over its samples with trained tokens, one weight per sample (``sequence`` and
``geometric`` levels), on all data-parallel ranks together, so that they average to 1 over
that set (verl's ``rollout_is_batch_normalize``). The mean is computed once per step from the
step's ``old_log_probs`` and the engine's log-probs, before its first micro-batch
(:func:`with_batch_mean`), which is why the flag makes the old-policy log-probs come from a
forward pass (:mod:`miles_core.old_policy`). A step whose mean is 0 (every weight rejected) is
left as it is. The metric ``tis_batch_mean`` is that mean (averaged over the steps).

The sequence levels need each sample whole in one micro-batch shard: a backend that splits a
sample's tokens across ranks (Megatron's context parallelism) refuses them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from miles_core.aggregation import all_reduce_host, segment_sum
from miles_core.batch import RolloutBatch

if TYPE_CHECKING:  # cycle: miles_core.losses imports this module
    from miles_core.losses import LossConfig

LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask")
LOG_RATIO_CLAMP = 20.0
#: The per-token field :func:`with_batch_mean` attaches: the step's mean weight.
BATCH_MEAN_FIELD = "tis_batch_mean"


def rollout_is_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    clip: float = 2.0,
    clip_low: float = 0.0,
    veto_threshold: float | None = None,
    loss_mask: torch.Tensor | None = None,
    sample_ids: torch.Tensor | None = None,
    num_samples: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w, changed, vetoed)`` per token (module docstring), each the shape of the log-probs;
    ``changed`` and ``vetoed`` are 1.0 where the truncation or mask changed the weight and
    where the veto zeroed it. ``loss_mask``, ``sample_ids`` (-1 on padding) and
    ``num_samples`` are needed at the sequence levels and for the veto."""
    if level not in LEVELS:
        raise ValueError(f"--tis-level must be one of {', '.join(LEVELS)}, got {level!r}")
    if mode not in MODES:
        raise ValueError(f"--tis-mode must be one of {', '.join(MODES)}, got {mode!r}")
    shape = old_log_probs.shape
    d = (old_log_probs - rollout_log_probs).detach().reshape(-1)
    per_sample = level != "token" or veto_threshold is not None
    if per_sample and (loss_mask is None or sample_ids is None or num_samples is None):
        raise ValueError(
            f"--tis-level {level} / --tis-veto-threshold need loss_mask, sample_ids and num_samples"
        )
    if per_sample:
        mask = loss_mask.reshape(-1).to(d.dtype)
        ids = sample_ids.reshape(-1).to(d.device)
        owner = ids.clamp(min=0).long()  # padding reads sample 0's value; its mask is 0
    if level == "token":
        log_w = d
    else:
        sums = segment_sum(d * mask, ids, num_samples)
        if level == "geometric":
            sums = sums / segment_sum(mask, ids, num_samples).clamp(min=1)
        log_w = sums[owner]
    raw = log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    if mode == "truncate":
        w = raw.clamp(clip_low, clip)
        changed = w != raw
    else:
        inside = (raw >= clip_low) & (raw <= clip)
        w = torch.where(inside, raw, torch.zeros_like(raw))
        changed = ~inside
    vetoed = torch.zeros_like(d, dtype=torch.bool)
    if veto_threshold is not None:
        token_ratio = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        low = ((token_ratio < veto_threshold) & (mask > 0)).to(d.dtype)
        vetoed = (segment_sum(low, ids, num_samples) > 0)[owner] & (ids >= 0)
        w = torch.where(vetoed, torch.zeros_like(w), w)
    return w.reshape(shape), changed.to(d.dtype).reshape(shape), vetoed.to(d.dtype).reshape(shape)


def configured_weights(
    config: LossConfig, old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, **where: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`rollout_is_weights` at ``config``'s (a :class:`~miles_core.losses.LossConfig`)
    level, mode, clips and veto; ``where``: its ``loss_mask``, ``sample_ids``, ``num_samples``."""
    return rollout_is_weights(
        old_log_probs,
        rollout_log_probs,
        level=config.tis_level,
        mode=config.tis_mode,
        clip=config.tis_clip,
        clip_low=config.tis_clip_low,
        veto_threshold=config.tis_veto_threshold,
        **where,
    )


def batch_mean(batch: RolloutBatch, config: LossConfig, group: Any = None) -> float:
    """The mean ``--tis-batch-normalize`` divides by (module docstring), over ``batch`` (this
    rank's part of an optimizer step, carrying ``old_log_probs`` and the engine's log-probs)
    and the same parts of the other ranks of ``group``, in float64. ``config``: a
    :class:`~miles_core.losses.LossConfig`. 1.0 where the mean is 0 or there is no trained
    token."""
    total = torch.zeros(2, dtype=torch.float64)  # (sum of weights, count)
    if len(batch):
        masks = batch.response_field("loss_mask")
        old = torch.cat(batch.response_field("old_log_probs")).double()
        rollout = torch.cat(batch.response_field("rollout_log_probs")).double()
        mask = torch.cat(masks).double()
        lengths = torch.tensor([m.numel() for m in masks])
        ids = torch.repeat_interleave(torch.arange(len(masks)), lengths)
        w, _, _ = configured_weights(
            config, old, rollout, loss_mask=mask, sample_ids=ids, num_samples=len(masks)
        )
        if config.tis_level == "token":
            total += torch.stack([(w * mask).sum(), mask.sum()])
        else:  # one weight per sample with trained tokens: all its tokens carry it
            tokens = segment_sum(mask, ids, len(masks))
            per_sample = segment_sum(w * mask, ids, len(masks)) / tokens.clamp(min=1)
            total += torch.stack([per_sample.sum(), (tokens > 0).double().sum()])
    total = all_reduce_host(total, dist.ReduceOp.SUM, group)
    weight_sum, count = float(total[0]), float(total[1])
    return weight_sum / count if weight_sum > 0 and count > 0 else 1.0


def with_batch_mean(batch: RolloutBatch, config: LossConfig, group: Any = None) -> RolloutBatch:
    """``batch`` (one optimizer step's part on this rank) with :data:`BATCH_MEAN_FIELD`, the
    step's :func:`batch_mean` on every token, under ``--use-tis --tis-batch-normalize``; else
    ``batch`` itself. A collective over ``group`` (the data-parallel ranks) when on."""
    if not (config.use_tis and config.tis_batch_normalize):
        return batch
    mean = batch_mean(batch, config, group)
    masks = batch.response_field("loss_mask") if len(batch) else []
    return batch.with_fields(**{BATCH_MEAN_FIELD: [torch.full_like(m, mean) for m in masks]})
