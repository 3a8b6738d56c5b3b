"""Activation recomputation on CPU (2 gloo ranks, the spawn test_layouts.py shares: conftest.py's
``two_rank_run``): ``--recompute-granularity full`` (``--recompute-method uniform`` and
``block``) and ``selective`` run megatron-core's ``tensor_parallel.checkpoint`` (the layers or
the core attention run again in the backward) and give no recompute's loss and gradients. The
activation memory it saves is measured on a GPU (tests/gpu/test_megatron_recompute_gpu.py)."""

from __future__ import annotations

import pytest
from recompute_ranks import check_recompute


@pytest.mark.slow
def test_recompute_equals_no_recompute(two_rank_run):
    for rank in two_rank_run:
        check_recompute(rank["recompute"])
