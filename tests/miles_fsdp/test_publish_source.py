"""The weight source publishes checkpoint dtypes, whatever the master dtype, a few at a time."""

from __future__ import annotations

import pytest
import torch
from miles_fsdp.backend import FSDPBackend
from run_args import make_args
from safetensors import safe_open
from tiny_models import qwen3_config, save_tiny_model

pytestmark = pytest.mark.slow


def test_bf16_checkpoint_trains_in_fp32_and_publishes_bf16(one_rank_group, tmp_path):
    hf_dir = save_tiny_model(
        tmp_path / "m", qwen3_config(tie_word_embeddings=True), dtype=torch.bfloat16
    )
    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=str(hf_dir)))
    assert {p.dtype for p in backend.model.parameters()} == {torch.float32}  # fp32 master
    published = list(backend.weight_source(gather_bytes=1))  # one tensor per gather
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        on_disk = {name: f.get_tensor(name) for name in f.keys()}
    assert [n for n, _ in published] and dict(published).keys() == on_disk.keys()
    assert "lm_head.weight" not in on_disk  # tied head stays out, as save_pretrained does
    for name, tensor in published:
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, on_disk[name]), name
    backend.close()
