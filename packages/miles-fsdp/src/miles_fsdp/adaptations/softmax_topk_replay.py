"""Routing replay for softmax top-k routers (Qwen3-MoE, Qwen3.5-MoE).

The model's own router computes ``p = softmax(h W^T)`` (fp32), takes the top-k of ``p`` and,
when ``norm_topk_prob`` (always for Qwen3.5-MoE), renormalises the k values to sum to 1. The
replayed router keeps everything but the choice of experts: with the engine's ids ``e``,

    w[t, j] = p[t, e[t, j]]   (then  w[t, j] / sum_j w[t, j]  if norm_topk_prob)

so the routing weights, and the router's gradient through them, are those of the model's code
evaluated at the replayed experts. Returns ``(router_logits, w, e)`` like the original.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from miles_fsdp.adaptations.moe import RoutingReplay, patch_routers


def replayed_softmax_topk(router: nn.Module, hidden: torch.Tensor, ids: torch.Tensor):
    """The router forward at given expert ids ``[T, k]`` (see the module docstring)."""
    hidden = hidden.reshape(-1, router.hidden_dim)
    logits = F.linear(hidden, router.weight)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    weights = probs.gather(-1, ids)
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(logits.dtype), ids


def patch_softmax_topk_routers(model: nn.Module, replay: RoutingReplay, classes: set[str]) -> int:
    """Make every softmax top-k router of a class in ``classes`` replay (see :func:`patch_routers`)."""
    return patch_routers(model, replay, classes, replayed_softmax_topk)
