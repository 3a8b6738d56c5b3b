"""How a training step's metrics combine over micro-batches, ranks and a rollout's optimizer
steps: one rule for both backends.

A loss returns named metrics, tensors without gradient; the name says how they combine:

- a *share* (any other name; 0-d): this micro-batch's share of a step mean
  (:mod:`miles_core.losses`). Summed over micro-batches, context-parallel and data-parallel
  ranks; averaged over the rollout's optimizer steps.
- an *extreme* (name ending in ``_max`` / ``_min``; 0-d): the largest / smallest value the
  micro-batch saw (``-inf`` / ``+inf`` when it saw none). Maximum / minimum over micro-batches,
  ranks and steps: an all-reduce MAX, never a SUM.
- a *per-sample* extreme (name ending in ``_sample_max`` / ``_sample_min``; 1-d): one value per
  sample of the micro-batch, the sample's share of its own mean (the part of the sample this
  rank holds: a context-parallel rank holds part of every sample, so the shares of the CP
  ranks add up to the sample's mean). Summed over the ``sample_group`` (the CP group; none
  where each rank holds its samples whole), then the extreme over the samples, then an
  extreme as above.

An extreme that saw no value anywhere (no trained token in the whole rollout) is left out of
the rollout's metrics (:func:`over_steps`).

Flow: each micro-batch's metrics go into a :class:`StepMetrics` (``add``); after the step's
last micro-batch, :meth:`StepMetrics.reduce` makes them one value each, the same on every rank
(two all-reduces: SUM for the shares, MAX for the extremes, a minimum being the maximum of the
negation); :func:`over_steps` combines the steps of a rollout.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

SUM, MAX, MIN = "sum", "max", "min"


def kind(name: str) -> str:
    """:data:`SUM`, :data:`MAX` or :data:`MIN`: how metric ``name`` combines (its suffix)."""
    if name.endswith("_max"):
        return MAX
    if name.endswith("_min"):
        return MIN
    return SUM


def per_sample(name: str) -> bool:
    """Whether metric ``name`` holds one value per sample of its micro-batch."""
    return name.endswith(("_sample_max", "_sample_min"))


def masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The largest of ``values`` where ``mask`` > 0, as a 0-d tensor (``-inf`` where none);
    no host wait."""
    flat = values.detach().reshape(-1)
    keep = mask.reshape(-1).to(flat.device) > 0
    none = torch.full((1,), -math.inf, dtype=flat.dtype, device=flat.device)
    return torch.cat([torch.where(keep, flat, none), none]).amax()


def masked_min(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The smallest of ``values`` where ``mask`` > 0 (``+inf`` where none)."""
    return -masked_max(-values, mask)


def _identity(how: str) -> float:
    return -math.inf if how == MAX else math.inf


def _all_reduce(flat: torch.Tensor, op: Any, group: Any) -> torch.Tensor:
    """``flat`` all-reduced over ``group`` (itself when torch.distributed is off or the group
    has one rank); an NCCL group's values go through the current CUDA device, a gloo group's
    through the host."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return flat
    if dist.get_backend(group) == "nccl":
        flat = flat.cuda()
    else:
        flat = flat.cpu()
    dist.all_reduce(flat, op=op, group=group)
    return flat


class StepMetrics:
    """The metrics of one optimizer step's micro-batches on this rank, combined as they arrive
    (on the device: no host wait per micro-batch)."""

    def __init__(self) -> None:
        self.values: dict[str, torch.Tensor] = {}
        self.samples: dict[str, list[torch.Tensor]] = {}

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        """One micro-batch's metrics (module docstring)."""
        for name, value in metrics.items():
            value = value.detach().float()
            if per_sample(name):
                self.samples.setdefault(name, []).append(value.reshape(-1))
                continue
            value = value.reshape(())
            old = self.values.get(name)
            how = kind(name)
            if old is None:
                self.values[name] = value
            elif how == SUM:
                self.values[name] = old + value
            elif how == MAX:
                self.values[name] = torch.maximum(old, value)
            else:
                self.values[name] = torch.minimum(old, value)

    def reduce(
        self, group: Any = None, sample_group: Any = None, also: torch.Tensor | None = None
    ) -> tuple[dict[str, float], float | None]:
        """Every metric combined over ``group`` (the data-parallel ranks, with the CP ranks
        under context parallelism) and, for the per-sample ones first, ``sample_group``; read
        to the host together with ``also`` (a 0-d tensor read as it is): one host wait."""
        values = dict(self.values)
        for name, parts in sorted(self.samples.items()):
            shares = torch.cat(parts)
            if sample_group is not None:
                shares = _all_reduce(shares, dist.ReduceOp.SUM, sample_group)
            how = kind(name)
            if shares.numel() == 0:
                values[name] = torch.tensor(_identity(how), device=shares.device)
            else:
                values[name] = shares.amax() if how == MAX else shares.amin()
        sums = sorted(k for k in values if kind(k) == SUM)
        extremes = sorted(k for k in values if kind(k) != SUM)
        device = next(iter(values.values())).device if values else None

        def stacked(keys: list[str], sign) -> torch.Tensor:
            return torch.stack([sign(k) * values[k].to(device).reshape(()) for k in keys])

        out: list[torch.Tensor] = []
        if sums:
            out.append(_all_reduce(stacked(sums, lambda k: 1.0), dist.ReduceOp.SUM, group))
        if extremes:  # min x = -max(-x): one MAX for both kinds
            signed = stacked(extremes, lambda k: 1.0 if kind(k) == MAX else -1.0)
            out.append(_all_reduce(signed, dist.ReduceOp.MAX, group))
        if also is not None:
            out.append(also.detach().float().reshape(1))
        host = torch.cat([t.to(out[0].device) for t in out]).cpu().tolist() if out else []
        reduced = dict(zip(sums, host[: len(sums)]))
        for k, v in zip(extremes, host[len(sums) : len(sums) + len(extremes)]):
            reduced[k] = v if kind(k) == MAX else -v
        return reduced, (host[-1] if also is not None else None)


def over_steps(steps: list[dict[str, float]]) -> dict[str, float]:
    """A rollout's metrics from its steps' reduced ones: the mean over steps of each share, the
    maximum / minimum of each extreme; an extreme that saw no value is left out."""
    out: dict[str, float] = {}
    for name in steps[0]:
        values = [s[name] for s in steps]
        how = kind(name)
        if how == SUM:
            out[name] = sum(values) / len(values)
            continue
        value = max(values) if how == MAX else min(values)
        if value != _identity(how):
            out[name] = value
    return out
