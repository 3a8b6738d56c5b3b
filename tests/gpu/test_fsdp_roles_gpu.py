"""FSDP roles on 2 GPUs (NCCL): sleep/wake of actor, reference, teacher, AdamW and EMA state
keeps outputs and optimizer updates equal to a never-slept control over 3 cycles.

Run on the device machine: ``uv run pytest tests/gpu/test_fsdp_roles_gpu.py`` (skipped
without CUDA).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "miles_fsdp"))

from role_programs import sleep_cycles_program  # noqa: E402
from spawn import run_ranks  # noqa: E402
from tiny_models import save_tiny_model  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


def test_sleep_wake_all_roles_matches_never_slept(tmp_path):
    dirs = [str(save_tiny_model(tmp_path / name, seed=s)) for s, name in enumerate("art")]
    data = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(3))
    out = tmp_path / "out.pt"
    run_ranks(2, sleep_cycles_program, *dirs, data, str(out), backend="nccl", timeout=400)
    res = torch.load(out, map_location="cpu", weights_only=False)
    for cycle, (control, slept) in enumerate(zip(res["control"], res["slept"])):
        for part in ("params", "ema"):
            for name, value in control[part].items():
                torch.testing.assert_close(
                    slept[part][name], value, atol=0, rtol=0, msg=f"cycle {cycle} {part} {name}"
                )
        for role, value in control["logits"].items():
            torch.testing.assert_close(
                slept["logits"][role], value, atol=0, rtol=0, msg=f"cycle {cycle} {role}"
            )
