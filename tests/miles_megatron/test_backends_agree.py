"""Both backends from one tiny HF checkpoint, 3 rollouts of 2 optimizer steps in fp32 with an
entropy bonus (the loss depends on the weights; the second step's PPO ratio is not 1): megatron
at TP=2 and FSDP give equal losses, and equal train/rollout mismatch metrics, within 1e-5. The
megatron run also carries the three hooks."""

from __future__ import annotations

import pytest
from dist_ranks import spawn_ranks
from megatron_ranks import rollout_losses
from megatron_tiny_models import make_tiny_hf

pytest.importorskip("miles_fsdp")


@pytest.mark.slow
def test_megatron_and_fsdp_losses_agree(tmp_path):
    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    (m0, hooks), (m1, _) = spawn_ranks(rollout_losses, 2, "megatron", hf_dir, 3, timeout=400)
    ((fsdp, _),) = spawn_ranks(rollout_losses, 1, "fsdp", hf_dir, 3, timeout=400, shim=False)
    assert m0 == m1  # TP peers report the same metrics
    assert len({loss for loss, _, _ in fsdp}) == 3  # the loss moves with the weights
    for m, f in zip(m0, fsdp, strict=True):  # loss, mismatch, importance-ratio std
        assert all(abs(a - b) < 1e-5 for a, b in zip(m, f, strict=True)), (m0, fsdp)
    # the samples carry engine log-probs far from the trainer's: the mismatch is reported
    assert all(mismatch > 0.1 and std > 0 for _, mismatch, std in fsdp)
    assert hooks[0][0] == "init" and hooks[0][1].endswith("Optimizer")
    expected = []
    for rollout in range(3):
        expected += [("log_prob", 4), ("train_step", rollout, 0), ("train_step", rollout, 1)]
    assert hooks[1:] == expected
