"""The Megatron backend's ``--attn-implementation varlen`` on a GPU: ``SDPAttention`` given the
packed row's boundaries runs torch's varlen flash kernel and equals the masked path (SDPA with
the block-causal mask), forward and input gradients, in bf16 at Qwen3-4B's attention shape and
16k packed tokens (tests/miles_megatron/test_megatron_varlen.py checks the same in float64 on a
CPU, at model and train-step level).

Run: ``python -m pytest tests/gpu/test_megatron_varlen_gpu.py -v`` (1 GPU; skipped without CUDA).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# the CPU tests' support: the rank functions and the spawn harness (NCCL, one GPU per rank)
sys.path.insert(0, str(Path(__file__).parents[1] / "miles_megatron"))
from dist_ranks import spawn_ranks  # noqa: E402


def test_megatron_varlen_attention_equals_masked_in_bf16():
    from miles_core.varlen_attention import kernel_available
    from varlen_ranks import gpu_varlen_vs_masked

    assert kernel_available("cuda"), "this torch has no varlen flash kernel"
    (result,) = spawn_ranks(gpu_varlen_vs_masked, 1, timeout=600, shim=False, backend="nccl")
    assert result["flash_calls"] == 1, result  # the varlen call ran the flash kernel
