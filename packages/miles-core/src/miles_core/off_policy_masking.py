"""Off-policy sequence masking (``--use-opsm``, slime's OPSM, after DeepSeek-V3.2): samples
that are both bad and stale leave the policy loss.

With ``delta_i = (1 / n_i) sum_{t in i} m_t (log pi_old(t) - log pi(t))`` (no gradient; ``n_i``
the sample's trained tokens, ``m`` the loss mask), a trained token ``t`` of sample ``i`` is
masked when its advantage ``A_t < 0`` and ``delta_i > --opsm-delta``: its policy-gradient term
becomes 0 (it still counts in the loss's denominator, so the other samples' weight does not
change). A sample the current policy already finds much less likely than ``pi_old`` did, and
whose advantage pushes it down further, gives a large, unreliable gradient; positive-advantage
samples are never masked.

``pi_old`` is the PPO ratio's old policy (:mod:`miles_core.old_policy`): the engine's under
``--use-rollout-logprobs``, so the mask then also catches samples the engine drew far from the
trainer; the policy before the rollout's updates otherwise, so at one step per rollout with the
trainer's own ``pi_old`` nothing can be masked and the flag is refused.

Metrics: ``opsm_masked_frac`` (the masked share of the trained tokens, aggregated like the
loss's other metrics) and ``opsm_masked_samples`` (samples with a masked token, summed over a
step's micro-batches and data-parallel ranks, averaged over the rollout's steps).

``delta_i`` needs the whole sample in one shard: Megatron refuses the flag at
``--context-parallel-size`` > 1.
"""

from __future__ import annotations

import torch

from miles_core.aggregation import segment_mean, segment_sum


def opsm_mask(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    sample_ids: torch.Tensor,
    num_samples: int,
    delta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(masked, samples)``: 1.0 per token where OPSM drops it (module docstring; shape of
    ``log_probs``), and the number of samples with a masked trained token (0-d)."""
    shape = log_probs.shape
    log_ratio = (old_log_probs - log_probs).detach().reshape(-1)
    per_sample = segment_mean(log_ratio, loss_mask, sample_ids, num_samples)
    ids = sample_ids.reshape(-1).to(log_ratio.device)
    stale = (per_sample > delta)[ids.clamp(min=0).long()] & (ids >= 0)
    masked = (stale & (advantages.reshape(-1) < 0)).to(log_ratio.dtype)
    trained = masked * loss_mask.reshape(-1).to(log_ratio.dtype)
    samples = (segment_sum(trained, ids, num_samples) > 0).to(log_ratio.dtype).sum()
    return masked.reshape(shape), samples
