"""Evaluation metrics of one eval set: reward mean, response length and pass@k.

A sample *passes* when its reward is positive. pass@k is the unbiased estimate of the chance
that at least one of ``k`` samples of a prompt passes, from its ``n`` samples of which ``c``
passed (``1 - C(n - c, k) / C(n, k)``, averaged over the prompts), for ``k = 1, 2, 4, ...`` up
to ``n = --n-samples-per-eval-prompt`` and ``k = n`` itself.
"""

from __future__ import annotations

from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """``1 - C(n - c, k) / C(n, k)``, as a product (no large binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def pass_ks(n: int) -> list[int]:
    """The ``k`` reported for ``n`` samples per prompt: powers of two below ``n``, and ``n``."""
    ks = []
    k = 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


def eval_metrics(groups: list[list[Any]]) -> dict[str, float]:
    """``reward_mean``, ``response_len_mean``, ``pass@k`` of the groups (samples with
    ``reward`` and ``response_ids``; every group as long as the first)."""
    samples = [s for g in groups for s in g]
    n = len(groups[0])
    metrics = {
        "reward_mean": sum(s.reward for s in samples) / len(samples),
        "response_len_mean": sum(len(s.response_ids) for s in samples) / len(samples),
    }
    for k in pass_ks(n):
        passed = [sum(1 for s in g if s.reward > 0) for g in groups]
        metrics[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in passed) / len(groups)
    return metrics
