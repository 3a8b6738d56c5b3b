"""--stream-optimizer-state-to-disk in the FSDP backend: the same training, checkpoints, refusals.

Reference: the backend's own in-memory AdamW (torch ``foreach`` on CPU). With fp32 moments the
streamed AdamW runs the same elementwise update on the same values, so the weights after
several rollouts (2 optimizer steps each, warmup + cosine schedule, clipping, weight decay)
must be bitwise equal, also across sleep/wake and a save/resume.
"""

from __future__ import annotations

import pytest
import torch
from spawn import run_ranks
from streamed_programs import streamed_program
from test_train import make_samples
from tiny_models import save_tiny_model

pytestmark = pytest.mark.slow


def test_streamed_optimizer_trains_and_resumes_bitwise(tmp_path):
    hf_dir = str(save_tiny_model(tmp_path / "qwen3"))
    out = tmp_path / "out.pt"
    run_ranks(2, streamed_program, hf_dir, make_samples(), str(tmp_path), str(out), timeout=300)
    got = torch.load(out, weights_only=True)

    memory, streamed, resumed = got["memory"]["params"], got["streamed"]["params"], got["resume"]
    assert resumed["start"] == 2
    for name, value in memory.items():
        assert not torch.equal(value, got["first"]["params"][name]), f"{name}: rollout 2 no-op"
        assert torch.equal(value, streamed[name]), name
        assert torch.equal(value, resumed["params"][name]), name

    optim_dir = tmp_path / "streamed-ckpt" / "iter_0000002" / "optimizer"
    assert len(list(optim_dir.glob("rank*/manifest.json"))) == 2
    assert "--stream-optimizer-state-to-disk" in got["streamed-into-memory"]
    assert "--no-load-optim" in got["streamed-into-memory"]
    assert "--no-load-optim" in got["dcp-into-streamed"]
    assert "without --stream-optimizer-state-to-disk" in got["dcp-into-streamed"]
