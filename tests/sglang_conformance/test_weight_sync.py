"""miles-sync's publisher against SGLang's own receive code (the engine stand-in), in every
transfer mode: buckets that mix bf16, fp16, fp32 and int64 tensors of odd lengths arrive bit for
bit, reconstructed by ``FlattenedTensorBucket`` (``empty`` + broadcast, or from a shared-memory
payload unpickled by SGLang's ``MultiprocessingSerializer``), or read from the puller's
safetensors directory."""

from __future__ import annotations

import pytest
import torch
from miles_sync.weight_sync import SyncConfig, WeightPublisher
from publishing import MODES, digests, puller
from safetensors.torch import save_file

BUCKET = 96  # bytes: several buckets, each holding several dtypes; "big" travels alone


def mixed_source(seed: int) -> list[tuple[str, torch.Tensor]]:
    """Odd lengths in every dtype; a bf16 tensor of odd length ahead of an fp32 one (the order
    SGLang refused before the layout was made dense)."""
    g = torch.Generator().manual_seed(seed)
    return [
        ("odd.bf16", torch.randn(3, generator=g).to(torch.bfloat16)),
        ("after.f32", torch.randn(5, generator=g)),
        ("ids.i64", torch.randint(-(1 << 40), 1 << 40, (3,), generator=g)),
        ("half.f16", torch.randn(7, generator=g).half()),
        ("m.bf16", torch.randn(3, 5, generator=g).to(torch.bfloat16)),
        ("tail.f32", torch.randn(1, generator=g)),
        ("big.f32", torch.randn(41, generator=g)),  # 164 bytes > BUCKET
        ("last.i64", torch.randint(0, 9, (1,), generator=g)),
    ]


@pytest.mark.parametrize("mode", MODES)
def test_mixed_dtype_buckets_arrive_bit_for_bit(mode, sglang_engine, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    save_file(dict(mixed_source(0)), str(base / "model.safetensors"))  # the delta's base
    config = SyncConfig(
        mode=mode,
        buffer_size=BUCKET,
        colocate=mode == "ipc",
        group_timeout_s=60,
        disk_dir=str(tmp_path / "shared") if mode == "disk-delta" else None,
        hf_checkpoint=str(base),
        puller_timeout_s=60,
    )
    publisher = WeightPublisher(config)
    sglang_engine.reset()
    with puller(sglang_engine.url, tmp_path / "shared", tmp_path / "local"):
        for seed in (1, 2):  # the second publish changes a published state
            source = mixed_source(seed)
            version = publisher.update_weights(iter(source), [sglang_engine.url])
            assert sglang_engine.version() == str(version)
            assert sglang_engine.digests() == digests(source), mode
    if mode != "disk-delta":
        assert publisher.last_stats["buckets"] > 2  # several buckets, mixed dtypes in each
    publisher.close()
