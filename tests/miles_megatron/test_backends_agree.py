"""Both backends from one tiny HF checkpoint, 3 rollouts in fp32 with an entropy bonus (so the
loss depends on the weights): megatron at TP=2 and FSDP give equal losses within 1e-5."""

from __future__ import annotations

import pytest
from dist_ranks import spawn_ranks
from megatron_ranks import rollout_losses
from tiny_models import make_tiny_hf

pytest.importorskip("miles_fsdp")


@pytest.mark.slow
def test_megatron_and_fsdp_losses_agree(tmp_path):
    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    megatron = spawn_ranks(rollout_losses, 2, "megatron", hf_dir, 3, timeout=400)
    fsdp = spawn_ranks(rollout_losses, 1, "fsdp", hf_dir, 3, timeout=400, shim=False)
    assert megatron[0] == megatron[1]  # TP peers report the same loss
    assert len(set(fsdp[0])) == 3  # the loss moves with the weights
    for m, f in zip(megatron[0], fsdp[0], strict=True):
        assert abs(m - f) < 1e-5, (megatron[0], fsdp[0])
