"""Routing replay for sigmoid routers with grouped top-k and a score-correction bias
(GLM-4.7-Flash, ``glm4_moe_lite``; the DeepSeek-V3 router).

The model's own router, in fp32:

    s = sigmoid(h W^T)
    choice = s + b                      (b: e_score_correction_bias, a buffer)
    groups = top-``topk_group`` of the ``n_group`` groups, a group scored by the sum of its
             two best ``choice`` values;  e = top-k of ``choice`` inside those groups
    w[t, j] = s[t, e_j]  (/ (sum_j s[t, e_j] + 1e-20)  if norm_topk_prob) * routed_scaling_factor

The bias and the group restriction only decide *which* experts; the weights are the unbiased
sigmoid scores. The replayed router drops the choice and keeps the weight formula at the
engine's ids ``e`` (which need not lie in the groups the trainer would pick), so the routing
weights and the router's gradient are the model's own at those experts. Returns
``(router_logits, w, e)`` like the original.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from miles_fsdp.adaptations.moe import RoutingReplay, patch_routers

#: The model's own epsilon in the renormalisation denominator.
NORM_EPS = 1e-20


def replayed_sigmoid_group_topk(router: nn.Module, hidden: torch.Tensor, ids: torch.Tensor):
    """The router forward at given expert ids ``[T, k]`` (see the module docstring)."""
    hidden = hidden.reshape(-1, router.hidden_dim)
    logits = F.linear(hidden.float(), router.weight.float())
    weights = logits.sigmoid().gather(1, ids)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + NORM_EPS)
    return logits, weights * router.routed_scaling_factor, ids


def patch_sigmoid_group_topk_routers(
    model: nn.Module, replay: RoutingReplay, classes: set[str]
) -> int:
    """Make every router of a class in ``classes`` replay (see :func:`patch_routers`)."""
    return patch_routers(model, replay, classes, replayed_sigmoid_group_topk)
