"""Converter: HF -> torch_dist (TP=2) -> HF (TP=1) reproduces every HF tensor bit for bit."""

from __future__ import annotations

import pytest
import torch
from dist_ranks import spawn_ranks
from megatron_ranks import convert_both_ways
from megatron_tiny_models import make_tiny_hf
from miles_core.checkpoint_layout import read_tracker
from safetensors.torch import load_file


@pytest.mark.slow
def test_hf_to_torch_dist_to_hf_bit_exact(tmp_path):
    hf_dir = make_tiny_hf("qwen3_moe", tmp_path / "hf")
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    spawn_ranks(convert_both_ways, 2, str(hf_dir), str(ckpt), str(out), timeout=400)
    assert read_tracker(ckpt) == 0
    original = load_file(hf_dir / "model.safetensors")
    converted = load_file(out / "model.safetensors")
    assert sorted(converted) == sorted(original)
    assert {t.dtype for t in original.values()} == {torch.float32}
    assert all(converted[k].dtype == torch.float32 for k in original)
    assert all(torch.equal(converted[k], original[k]) for k in original)
    assert (out / "config.json").read_text() == (hf_dir / "config.json").read_text()


@pytest.mark.extended
def test_cli_round_trip_binds_no_port(tmp_path):
    """``python -m miles_megatron.convert`` both ways, one process each with no rendezvous in the
    environment, while every port a fixed default could name is held elsewhere: the one-process
    conversion binds no port (it once bound 29533, and two conversions on a node collided)."""
    import contextlib
    import socket
    import subprocess
    import sys

    from megatron_cli import megatron_cli_env
    from timeouts import scaled

    hf_dir = make_tiny_hf("qwen3", tmp_path / "hf")
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    env = megatron_cli_env()  # the CPU shim (megatron's CUDA RNG tracker), nothing else
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        env.pop(name, None)
    env.update(OMP_NUM_THREADS="1")
    with contextlib.ExitStack() as stack:
        held = []
        for port in (29500, 29533):  # torch's and this CLI's old default
            s = stack.enter_context(socket.socket())
            with contextlib.suppress(OSError):
                s.bind(("127.0.0.1", port))
                s.listen()
                held.append(port)
        assert held, "neither default port could be held: the test would prove nothing"
        for argv in (
            ["hf-to-torch-dist", "--hf-checkpoint", str(hf_dir), "--save", str(ckpt)],
            ["torch-dist-to-hf", "--hf-checkpoint", str(hf_dir), "--load", str(ckpt),
             "--save", str(out)],
        ):  # fmt: skip
            done = subprocess.run(
                [sys.executable, "-m", "miles_megatron.convert", *argv],
                env=env, capture_output=True, text=True, timeout=scaled(300),
            )  # fmt: skip
            assert done.returncode == 0, done.stderr[-3000:]
    assert read_tracker(ckpt) == 0
    original = load_file(hf_dir / "model.safetensors")
    converted = load_file(out / "model.safetensors")
    assert sorted(converted) == sorted(original)
    assert all(torch.equal(converted[k], original[k]) for k in original)
