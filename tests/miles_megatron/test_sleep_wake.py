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
