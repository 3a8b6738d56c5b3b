"""Rollout samples of random tokens over the tiny models' 64-token vocabulary, for every FSDP test
that trains or scores a batch (importable by spawned children)."""

from __future__ import annotations

import torch


def tool_span_mask(response_length: int) -> torch.Tensor:
    """A multi-turn ``loss_mask``: 0 on a tool-output span after the first response token
    (``response_length // 3`` tokens), 1 elsewhere."""
    mask = torch.ones(response_length)
    mask[1 : 1 + response_length // 3] = 0
    return mask


def make_samples(
    n: int = 4, seed: int = 11, group_size: int = 2, short: bool = False, masked: bool = False
):
    """``n`` samples in groups of ``group_size`` with rewards in [0, 1). Lengths vary per sample:
    prompt ``3 + i % 3``, response ``4 + 5i % 7`` (``short``: ``3 + i % 2`` and ``3 + i % 3``,
    for the MoE kernels run under Triton's interpreter); ``masked``: with
    :func:`tool_span_mask` loss masks."""
    from miles_core.batch import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        if short:
            prompt, response = 3 + i % 2, 3 + i % 3
        else:
            prompt, response = 3 + i % 3, 4 + (i * 5) % 7
        out.append(
            Sample(
                tokens=torch.randint(0, 64, (prompt + response,), generator=g),
                response_length=response,
                reward=float(torch.rand((), generator=g)),
                group_index=i // group_size,
                loss_mask=tool_span_mask(response) if masked else None,
            )
        )
    return out
