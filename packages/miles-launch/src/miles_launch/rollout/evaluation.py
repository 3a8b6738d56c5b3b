"""pass@k and the evaluation metrics of one eval set: reward mean, response length, pass@k.

A sample *passes* when its reward is at least ``--pass-threshold`` (default 1.0: the maximum
of both built-in rewards, so a sample passes when it earned the task's full reward; a shaped
reward's partial credit, e.g. 0.5 for calling a tool, is no pass). For a custom or remote
reward, set it to that reward's pass criterion.

pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained
on Code", eq. 1): the chance that at least one of ``k`` samples of a prompt passes, from its
``n`` samples of which ``c`` passed, ``1 - C(n - c, k) / C(n, k)``, averaged over the prompts.
Each prompt group uses its own ``n`` (a custom generate function may return several samples
per call, so groups can differ in size); ``k`` runs over ``1, 2, 4, ...`` below the smallest
group's ``n`` and that ``n`` itself (every ``k`` is then defined for every group).
"""

from __future__ import annotations

from collections.abc import Sequence
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


def pass_at_ks(groups: Sequence[Sequence[Any]], threshold: float) -> dict[str, float]:
    """``{"pass@k": ...}`` of prompt groups (samples with a ``reward``; a sample passes when
    ``reward >= threshold``), each group with its own ``n``; see the module docstring."""
    groups = [g for g in groups if len(g)]
    if not groups:
        return {}
    counts = [(len(g), sum(1 for s in g if s.reward >= threshold)) for g in groups]
    return {
        f"pass@{k}": sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)
        for k in pass_ks(min(n for n, _ in counts))
    }


def eval_metrics(groups: list[list[Any]], threshold: float = 1.0) -> dict[str, float]:
    """``reward_mean``, ``response_len_mean``, ``pass@k`` of the groups (samples with
    ``reward`` and ``response_ids``); ``threshold``: ``--pass-threshold``."""
    samples = [s for g in groups for s in g]
    return {
        "reward_mean": sum(s.reward for s in samples) / len(samples),
        "response_len_mean": sum(len(s.response_ids) for s in samples) / len(samples),
        **pass_at_ks(groups, threshold),
    }
