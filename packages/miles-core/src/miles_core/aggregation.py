"""Reducing per-token values to a loss whose gradient does not depend on how data is split.

A training step sees ``S`` samples (across all data-parallel ranks and micro-batches) with
``N = sum_i n_i`` loss tokens (``n_i`` masked response tokens of sample ``i``). The two
aggregations (``--calculate-per-token-loss`` picks the first) are

* token mean:    ``L = (1 / N) * sum_i sum_{t in i} m_t x_t``
* sequence mean: ``L = (1 / S) * sum_i (1 / max(n_i, 1)) * sum_{t in i} m_t x_t``

Both are sums over samples of terms that need only that sample plus one global constant, the
*denominator* (``N`` or ``S``). :func:`loss_denominator` computes it once per step, up front
(all-reduced across DP ranks); :func:`aggregate` then gives each micro-batch its share. Summing
the micro-batch results of all micro-batches on all ranks gives ``L`` exactly, so the gradient is
the same for any micro-batch split and DP size. Note that this makes the step gradient the *sum*
of the ranks' gradients: a data-parallel wrapper that averages gradients (FSDP, DDP) must be
compensated by multiplying each rank's loss by ``dp_size``.

A sample with no loss tokens counts in ``S`` and contributes zero.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from miles_core.batch import RolloutBatch


def all_reduce_host(
    tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """All-reduce a small host tensor over ``group`` and return it (unchanged when
    torch.distributed is not initialized). Meant for a gloo group; on an NCCL group the values
    take a round trip through the current CUDA device."""
    if not (dist.is_available() and dist.is_initialized()):
        return tensor
    if dist.get_backend(group) == "nccl":
        on_device = tensor.cuda()
        dist.all_reduce(on_device, op=op, group=group)
        return on_device.cpu()
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


def loss_denominator(
    step_batch: RolloutBatch,
    per_token_loss: bool,
    group: dist.ProcessGroup | None = None,
) -> float:
    """``N`` (loss tokens, ``per_token_loss``) or ``S`` (samples) of the whole step.

    ``step_batch`` is this rank's data for the optimizer step; the local count is summed over
    ``group`` (a gloo group, or the default group) when torch.distributed is initialized. Returns
    at least 1 so that an all-masked step gives a zero loss instead of NaN.
    """
    local = step_batch.num_loss_tokens if per_token_loss else len(step_batch)
    count = torch.tensor([float(local)], dtype=torch.float64)
    count = all_reduce_host(count, dist.ReduceOp.SUM, group)
    return max(float(count.item()), 1.0)


def segment_sum(values: torch.Tensor, sample_ids: torch.Tensor, num_samples: int) -> torch.Tensor:
    """``out[i] = sum of values[t] over positions t with sample_ids[t] == i``; ids < 0 (padding)
    are dropped. ``values`` and ``sample_ids`` are flattened; differentiable in ``values``."""
    values = values.reshape(-1)
    ids = sample_ids.reshape(-1).to(values.device)
    keep = ids >= 0
    out = torch.zeros(num_samples, dtype=values.dtype, device=values.device)
    if num_samples == 0:  # an empty micro-batch (a rank's part of a step): still in the graph
        return out.index_add(0, ids[:0].long(), values[:0])
    # padding adds an exact zero to sample 0 instead of being selected out: a boolean index
    # would make the host wait for the device to learn how many positions it keeps
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    return out.index_add(0, ids.clamp(min=0).long(), torch.where(keep, values, zero))


def aggregate(
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    denominator: float,
    per_token_loss: bool,
    sample_ids: torch.Tensor | None = None,
    num_samples: int | None = None,
    sample_loss_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the token-mean / sequence-mean (see the module docstring).

    ``values`` and ``loss_mask`` are per-token (any shape, flattened). Sequence mean needs
    ``sample_ids`` (same shape, -1 for padding) and ``num_samples``; ``n_i`` is counted from
    ``loss_mask`` unless ``sample_loss_tokens`` (``[num_samples]``) gives it, which a rank holding
    only part of each sample (context parallelism) must do.
    """
    masked = values.reshape(-1) * loss_mask.reshape(-1).to(values.dtype)
    if per_token_loss:
        return masked.sum() / denominator
    if sample_ids is None or num_samples is None:
        raise ValueError("sequence-mean aggregation needs sample_ids and num_samples")
    per_sample = segment_sum(masked, sample_ids, num_samples)
    if sample_loss_tokens is None:
        counts = segment_sum(loss_mask.reshape(-1).to(values.dtype), sample_ids, num_samples)
    else:
        counts = sample_loss_tokens.to(device=values.device, dtype=values.dtype)
    return (per_sample / counts.clamp(min=1)).sum() / denominator


def segment_mean(
    values: torch.Tensor, loss_mask: torch.Tensor, sample_ids: torch.Tensor, num_samples: int
) -> torch.Tensor:
    """Masked mean of ``values`` per sample, ``[num_samples]`` (0 for a sample with no tokens)."""
    mask = loss_mask.reshape(-1).to(values.dtype)
    sums = segment_sum(values.reshape(-1) * mask, sample_ids, num_samples)
    return sums / segment_sum(mask, sample_ids, num_samples).clamp(min=1)
