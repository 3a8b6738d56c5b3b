"""``--custom-loss-function-path`` hooks written for test_megatron_loss_type.py (importable by the
spawned ranks of both backends): the REINFORCE loss ``sum over loss tokens of -A_t log pi_t``
divided by the step's denominator, ``log pi_t`` at ``config.temperature``, from the logits
(:func:`reinforce_logits`) or from the backend's log-prob head (:func:`reinforce_scores`)."""

from __future__ import annotations

import torch


def _result(log_probs: torch.Tensor, packed, denominator: float):
    terms = -packed.fields["advantages"] * log_probs * packed.loss_mask
    contribution = terms.sum() / denominator
    # "calls" counts the micro-batches the hook saw; "token_share" sums to 1 over the step
    parts = {"reinforce": contribution.detach(), "calls": 1.0}
    parts["token_share"] = packed.loss_mask.sum() / denominator
    return contribution, parts


def reinforce_logits(ctx, logits, packed, config, denominator):
    log_p = torch.log_softmax(logits.float() / config.temperature, dim=-1)
    log_probs = log_p.gather(-1, packed.targets.long().unsqueeze(-1)).squeeze(-1)
    return _result(log_probs, packed, denominator)


def reinforce_scores(ctx, scores, packed, config, denominator):
    return _result(scores.log_probs, packed, denominator)


def no_gradient(ctx, scores, packed, config, denominator):
    """Returns a loss computed from detached inputs: refused when it comes back."""
    return (scores.log_probs.detach() * packed.loss_mask).sum() / denominator, {}
