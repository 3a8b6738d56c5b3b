"""SDPAttention (the local spec's core attention) computes megatron's DotProductAttention:
outputs and input gradients against a float64 reference written here and against megatron's
own module, fp32, with grouped-query heads, a block-causal packing mask and query-key layer
scaling; and the local spec uses it in every layer."""

from __future__ import annotations

import pytest
from dist_ranks import spawn_ranks
from sdpa_attention_ranks import CASES, compare_all

pytestmark = pytest.mark.numeric


def test_sdpa_attention_equals_megatron_and_float64():
    (result,) = spawn_ranks(compare_all, 1)
    assert result["classes"] == {"SDPAttention"}
    for name in CASES:
        diffs = result[name]
        assert max(diffs.values()) < 1e-5, (name, diffs)
