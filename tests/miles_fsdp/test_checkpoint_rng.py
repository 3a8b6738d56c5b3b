"""rng.pt: --load restores every rank's torch and Python RNG to the state at save time;
--no-load-rng leaves them as a fresh start (seeded from --seed) would have them."""

from __future__ import annotations

import os
import random

import pytest
import torch
from miles_core.checkpoint_layout import iteration_dir_name
from miles_core.safe_load import UnsafeCheckpointFileError
from miles_fsdp.backend import FSDPBackend
from role_programs import my_shard
from run_args import make_args
from samples import make_samples
from tiny_models import save_tiny_model

pytestmark = pytest.mark.slow


def draws() -> tuple[list[float], float]:
    return torch.rand(4).tolist(), random.random()


def started(**flags) -> tuple[list[float], float]:
    backend = FSDPBackend()
    backend.init(make_args(**flags))
    out = draws()
    backend.close()
    return out


def test_load_rng_and_no_load_rng(one_rank_group, tmp_path):
    hf_dir = str(save_tiny_model(tmp_path / "qwen3"))
    save = str(tmp_path / "ckpt")
    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=hf_dir, save=save, advantage_estimator="grpo"))
    backend.train(0, my_shard(make_samples(), 0, 1))
    torch.rand(7), random.random()  # the run's RNG moves away from the seed
    backend.save_model(0, force_sync=True)
    at_save = draws()
    backend.close()

    fresh = started(hf_checkpoint=hf_dir)
    assert started(hf_checkpoint=hf_dir, load=save) == at_save
    assert started(hf_checkpoint=hf_dir, load=save, load_rng=False) == fresh
    assert fresh != at_save

    # rng.pt is read with weights_only=True: a planted file that would run code fails the
    # load, naming it, and runs nothing.
    marker = tmp_path / "pwned"

    class Planted:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    rng_file = tmp_path / "ckpt" / iteration_dir_name(1) / "rng.pt"
    assert rng_file.is_file()
    torch.save({"world_size": 1, "states": [Planted()]}, rng_file)
    with pytest.raises(UnsafeCheckpointFileError, match="rng.pt: refused"):
        started(hf_checkpoint=hf_dir, load=save)
    assert not marker.exists()
