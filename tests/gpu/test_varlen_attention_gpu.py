"""torch's varlen flash kernel (``--attn-implementation varlen``) on a GPU: the same attention as
one causal SDPA per sample (the CPU path), forward and backward, in bf16 at 16k packed tokens.

Run on a GPU node: ``pytest tests/gpu/test_varlen_attention_gpu.py`` (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from miles_core import varlen_attention as va

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_flash_varlen_equals_per_sample_sdpa_in_bf16():
    assert va.kernel_available("cuda"), "this torch has no varlen flash kernel"
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [2048, 512, 4096, 1, 3000, 6727]
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)

    def qkv():
        q = torch.randn(total, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        return [t.requires_grad_() for t in (q, k, v)]

    inputs = qkv()
    ref_inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = va.varlen_causal_attention(*inputs, cu, max(lengths), scale=128**-0.5)
    ref = va._per_sample(*ref_inputs, cu.cuda(), 128**-0.5)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    for mine, theirs in zip(inputs, ref_inputs, strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=5e-2, atol=5e-2)
