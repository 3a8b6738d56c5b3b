"""StreamedAdamW on a CUDA device: fused AdamW bit-identity, at most 3 buckets resident.

Skipped without CUDA (tests/conftest.py). Run on a GPU node with
``python -m pytest tests/gpu/test_streamed_adam_gpu.py``.
"""

from __future__ import annotations

import copy

import miles_native
import pytest
import torch
from miles_offload.streamed_adam import StreamedAdamConfig, StreamedAdamW
from torch import nn

pytestmark = pytest.mark.gpu

LR, WD, BETAS, EPS = 1e-3, 0.1, (0.9, 0.95), 1e-8


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 4 x 3M + 2M elements streamed; the biases stay on an ordinary AdamW
    return nn.Sequential(*[nn.Linear(2048, 1536) for _ in range(4)], nn.Linear(1536, 1280)).cuda()


def _grads(model: nn.Module, step: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, device="cuda", generator=g) * 1e-2


def _streamed(model, tmp_path, moment_dtype="fp32") -> StreamedAdamW:
    config = StreamedAdamConfig(
        disk_dir=str(tmp_path),
        moment_dtype=moment_dtype,
        bucket_numel=2_500_000,
        min_numel=65536,
        chunk_mb=4,
        fused=True,
    )
    return StreamedAdamW(
        model.named_parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, config=config
    )


def test_fused_fp32_bit_identical_and_three_buckets_resident(tmp_path):
    assert miles_native.cuda_runtime_available()
    model = _model()
    ref_model = copy.deepcopy(model)
    opt = _streamed(model, tmp_path)
    ref = torch.optim.AdamW(
        ref_model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True
    )
    assert len(opt.buckets) >= 5
    slot = max(b.nbytes for b in opt.buckets)
    for step in range(1, 5):
        _grads(model, step)
        _grads(ref_model, step)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        opt.step()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        assert extra <= 3 * slot + (1 << 20), (extra, slot)  # 3 bucket buffers + scalars
        ref.step()
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            assert torch.equal(p, q), (step, name)
    st = opt.read_state("0.weight")
    rs = ref.state[ref_model[0].weight]
    assert torch.equal(st["exp_avg"], rs["exp_avg"].reshape(-1).cpu())
    assert torch.equal(st["exp_avg_sq"], rs["exp_avg_sq"].reshape(-1).cpu())
    opt.close()


def test_bf16_moments_close_and_resume(tmp_path):
    model = _model()
    ref_model = copy.deepcopy(model)
    opt = _streamed(model, tmp_path, moment_dtype="bf16")
    ref = torch.optim.AdamW(
        ref_model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True
    )
    for step in range(1, 4):
        _grads(model, step)
        _grads(ref_model, step)
        opt.step()
        ref.step()
    opt.save(str(tmp_path / "ckpt"))
    resumed = copy.deepcopy(model)
    opt2 = _streamed(resumed, tmp_path, moment_dtype="bf16")
    opt2.load(str(tmp_path / "ckpt"))
    for m, o in ((model, opt), (resumed, opt2), (ref_model, ref)):
        _grads(m, 4)
        o.step()
    for p, q, r in zip(model.parameters(), resumed.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)  # the resumed run continues bitwise
        torch.testing.assert_close(p, r, rtol=0, atol=4 * LR * 2**-5)
    opt.close()
    opt2.close()
