"""sleep/wake between rollouts: the buffers' and optimizer's storage is released while asleep,
and training continues bit-exact as if it never slept (TP=2, distributed optimizer)."""

from __future__ import annotations

import pytest
from dist_ranks import spawn_ranks
from megatron_ranks import sleep_between_rollouts
from megatron_tiny_models import make_tiny_hf


@pytest.mark.slow
def test_sleep_wake_is_invisible_to_training(tmp_path):
    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    for s, a in spawn_ranks(sleep_between_rollouts, 2, hf_dir, timeout=500):
        assert s["awake"] > 100_000 and s["asleep"] == 0
        assert s["losses"] == a["losses"]
        assert s["weights"] == a["weights"]


@pytest.mark.slow
@pytest.mark.extended  # a spawned Megatron rank: about a minute on 2 busy cores
def test_a_failed_wake_is_one_clear_error_and_a_retry_restores(tmp_path):
    """The wake's first growth (a parameter buffer) and its last (a gradient buffer) fail in
    turn with the allocator's error: WakeFailed names the role, the stage, the buffer and its
    bytes (the storage's size measured awake), every storage is freed again, and a wake
    without the fault gives back the weights of before the sleep, bit for bit."""
    from wake_failure_ranks import failed_wake_then_retry

    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    (result,) = spawn_ranks(failed_wake_then_retry, 1, hf_dir, timeout=300)
    first, last = result["failures"]
    assert first["stage"] == "parameters" and first["key"] == "buffer0.param_data"
    assert last["stage"] == "gradients" and last["key"].endswith(".grad_data")
    for failure in (first, last):
        assert failure["key"] == failure["expected_key"]
        assert failure["asked"] == failure["expected_bytes"] > 0
        message = failure["message"]
        assert message.startswith(f"wake of actor failed allocating its {failure['stage']} (")
        assert f"({failure['asked']} bytes) asked" in message
        assert failure["asleep"] and failure["device_bytes"] == 0
    assert result["equal"] == [True, True]
