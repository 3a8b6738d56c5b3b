"""Activation recomputation on one GPU (megatron-core's CUDA RNG tracker and checkpointing,
no CPU shim): every ``--recompute-granularity`` case equals no recompute (loss, gradients:
tests/miles_megatron/test_recompute.py's check) and full recompute leaves less activation
memory for the backward: recomputing each of the 2 layers (uniform, 1 layer a chunk) keeps only
the layer inputs, the first block of 1 layer keeps the second layer's activations, so
uniform < block < none; selective (core attention only) never keeps more than none.

Run: ``python -m pytest tests/gpu/test_megatron_recompute_gpu.py -v``.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

sys.path.insert(0, str(Path(__file__).parents[1] / "miles_megatron"))
from dist_ranks import spawn_ranks  # noqa: E402

nccl_ranks = functools.partial(spawn_ranks, timeout=600, shim=False, backend="nccl")


def test_recompute_equals_no_recompute_with_less_activation_memory(tmp_path):
    from megatron_tiny_models import make_tiny_hf
    from recompute_ranks import RECOMPUTE_CASES, check_recompute, recompute_run

    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    (result,) = nccl_ranks(recompute_run, 1, hf_dir, RECOMPUTE_CASES)
    check_recompute(result)
    used = {label: case["activation_bytes"] for label, case in result.items()}
    assert used["full_uniform"] < used["full_block"] < used["none"], used
    assert used["selective"] <= used["none"], used
