"""Checkpoints on 2 gloo ranks (TP=2): ``--async-save`` writes in the background and commits the
tracker only after the write (the previous iteration stays tracked while it is in flight), and
its checkpoint equals a synchronous save's bit for bit; a ``--save-trigger-sentinel`` request
(the launcher's save point) is a synchronous save, durable before the sentinel is removed; ``rng.pt`` makes the resumed run draw
the same random numbers and compute the same next loss as the run that never stopped."""

from __future__ import annotations

import pytest
from dist_ranks import spawn_ranks
from megatron_ranks import async_then_sync_saves
from megatron_tiny_models import make_tiny_hf


@pytest.mark.slow
def test_async_save_equals_sync_save_and_resume_is_bitwise(tmp_path):
    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    results = spawn_ranks(async_then_sync_saves, 2, hf_dir, str(tmp_path), timeout=500)
    for r in results:
        # a sentinel request saves synchronously, even under --async-save, then is consumed
        assert r["async_tracker_forced"] == 1 and r["sync_tracker_forced"] == 1
        assert not r["async_sentinel_left"] and not r["sync_sentinel_left"]
        # in flight: a crash now would resume from iteration 1; the sync save is at 2 at once
        assert r["async_tracker_in_flight"] == 1 and r["sync_tracker_in_flight"] == 2
        assert r["async_tracker_closed"] == 2 and r["sync_tracker_closed"] == 2
        assert r["async_weights"] == r["sync_weights"]  # same training either way
        for mode in ("async", "sync"):
            assert r[mode + "_resumed_id"] == 2
            assert r[mode + "_resumed_weights"] == r[mode + "_weights"]  # bit for bit
            assert r[mode + "_resumed_draws"] == r[mode + "_draws"]  # rng.pt restored
            assert r[mode + "_resumed_loss_2"] == r[mode + "_loss_2"]
    # every stream (python, numpy, torch) of rank 0 differs from rank 1's at the save, so each
    # rank's resumed draws equalling its own (above) means each restored its own state
    for mode in ("async", "sync"):
        draws = [r[mode + "_draws"] for r in results]
        assert all(a != b for a, b in zip(*draws, strict=True)), draws


def test_async_save_names_megatron_cores_own_writer(monkeypatch):
    """megatron-core 0.19's ``save`` defaults to the nvidia-resiliency-ext writer ("nvrx"); an
    async save names its own ("mcore") wherever the argument exists (0.16 has neither)."""
    import inspect

    from megatron.core import dist_checkpointing
    from miles_megatron.mcore_compat import async_save_kwargs

    installed = "async_strategy" in inspect.signature(dist_checkpointing.save).parameters
    assert async_save_kwargs() == ({"async_strategy": "mcore"} if installed else {})

    def save_019(
        sharded_state_dict, checkpoint_dir, async_sharded_save=False, async_strategy="nvrx"
    ):
        raise AssertionError("not called")

    def save_016(sharded_state_dict, checkpoint_dir, async_sharded_save=False):
        raise AssertionError("not called")

    monkeypatch.setattr(dist_checkpointing, "save", save_019)
    assert async_save_kwargs() == {"async_strategy": "mcore"}
    monkeypatch.setattr(dist_checkpointing, "save", save_016)
    assert async_save_kwargs() == {}
