"""Checkpoint state files load with ``weights_only=True``: RNG states (python, numpy, torch)
round-trip, and a file that would run code on load is refused naming the file, both through
miles_core.safe_load and at the backends' own load sites (FSDP rng.pt, Megatron rng.pt)."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from miles_core.safe_load import UnsafeCheckpointFileError, load_state_file


class _Planted:
    """What a hostile rng.pt carries: a reduce to os.system."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(path, marker) -> None:
    torch.save({"world_size": 1, "states": [{"python": _Planted(marker)}]}, path)


def test_rng_states_round_trip(tmp_path):
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": {"model-parallel-rng": torch.get_rng_state()},
    }
    torch.save({"world_size": 1, "states": [state]}, tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    loaded = load_state_file(tmp_path / "rng.pt")["states"][0]
    random.setstate(loaded["python"])
    np.random.set_state(loaded["numpy"])
    torch.set_rng_state(loaded["torch"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_planted_file_is_refused_naming_the_file(tmp_path):
    marker = tmp_path / "pwned"
    _plant(tmp_path / "rng.pt", marker)
    with pytest.raises(UnsafeCheckpointFileError, match="rng.pt: refused to load.*system"):
        load_state_file(tmp_path / "rng.pt")
    assert not marker.exists()


def test_megatron_load_rng_refuses_a_planted_file(tmp_path):
    pytest.importorskip("megatron.core")
    from miles_megatron.checkpoint import RNG_FILENAME, load_rng

    marker = tmp_path / "pwned"
    _plant(tmp_path / RNG_FILENAME, marker)
    with pytest.raises(UnsafeCheckpointFileError, match=RNG_FILENAME):
        load_rng(tmp_path)
    assert not marker.exists()
