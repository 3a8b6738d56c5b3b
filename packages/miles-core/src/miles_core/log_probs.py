"""Per-token log-probabilities and entropies from logits, at the sampling temperature.

The engine samples from ``softmax(z / T)`` with ``T = --rollout-temperature``; the trainer must
score tokens under the same distribution for the importance ratios to be meaningful.
"""

from __future__ import annotations

import torch

from miles_core import batch_invariant


def scaled_log_softmax(logits: torch.Tensor, temperature: torch.Tensor | float) -> torch.Tensor:
    """``log_softmax(logits.float() / temperature, -1)``: the one function the trainer
    (:func:`token_log_probs`) and the built-in engine's sampler (a tensor of one temperature
    per row) take their log-probs with. Within :func:`miles_core.batch_invariant.mode`, CUDA
    logits go through its GPU kernel."""
    if logits.is_cuda and batch_invariant.active():
        return batch_invariant.log_softmax(logits, temperature)
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def token_log_probs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``log softmax(logits / temperature)[target]`` per position, in float32.

    ``logits``: ``[..., V]``; ``targets``: int ``[...]`` (the next token of each position, see
    :class:`~miles_core.packing.PackedBatch`). Returns ``[...]``.
    """
    if temperature <= 0:
        raise ValueError(f"--rollout-temperature must be > 0 for log-probs, got {temperature}")
    log_p = scaled_log_softmax(logits, temperature)
    return log_p.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy ``H = -sum_v p_v log p_v`` of ``p = softmax(logits / temperature)`` per position.

    Computed from ``log_softmax`` in float32 (no cancellation for peaked distributions).
    Returns ``logits.shape[:-1]``.
    """
    if temperature <= 0:
        raise ValueError(f"--rollout-temperature must be > 0 for entropy, got {temperature}")
    z = logits.float() / temperature
    log_p = torch.log_softmax(z, dim=-1)
    return -(log_p.exp() * log_p).sum(dim=-1)
