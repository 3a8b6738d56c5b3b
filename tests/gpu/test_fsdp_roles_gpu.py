"""FSDP roles on 2 GPUs (NCCL): sleep/wake of actor, reference, teacher, their buffers, AdamW
and EMA state keeps outputs and optimizer updates equal to a never-slept control over 3
cycles, bit for bit, and each sleep really releases that state's device memory.

Run on a GPU node (2 GPUs)::

    CUBLAS_WORKSPACE_CONFIG=:4096:8 uv run pytest -q tests/gpu/test_fsdp_roles_gpu.py

(skipped without 2 CUDA devices). Eager attention keeps the comparison deterministic (the
memory-efficient SDPA backward is not). The same program runs on gloo CPU ranks in
tests/miles_fsdp/test_roles.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "miles_fsdp"))

from role_programs import sleep_cycles_program  # noqa: E402
from spawn import run_ranks  # noqa: E402
from test_roles import assert_sleep_cycles_match  # noqa: E402
from tiny_models import save_tiny_model  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


def test_sleep_wake_all_roles_matches_never_slept(tmp_path, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # inherited by the spawned ranks
    dirs = [str(save_tiny_model(tmp_path / name, seed=s)) for s, name in enumerate("art")]
    data = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(3))
    out = tmp_path / "out.pt"
    run_ranks(2, sleep_cycles_program, *dirs, data, str(out), "eager", backend="nccl", timeout=400)
    res = torch.load(out, map_location="cpu", weights_only=True)
    assert_sleep_cycles_match(res)
    for cycle in res["slept"]:
        memory = cycle["memory"]
        # every role's shards, buffers, AdamW and EMA state were on the GPU and left it
        assert memory["must_move"] > 0 and memory["left_on_device"] == 0
        assert memory["before"] - memory["after"] >= memory["must_move"], memory
