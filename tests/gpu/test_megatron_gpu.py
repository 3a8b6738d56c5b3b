"""MegatronBackend on GPUs with NCCL (TP=2 on 2 devices, TP=1 on one): two rollouts through DDP
and the distributed optimizer match an HF model trained with torch AdamW, and the checkpoint
resumes at TP=1 bit-exact. Same checks as tests/miles_megatron/test_backend.py (gloo + shim).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import traceback
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SUPPORT = str(Path(__file__).parents[1] / "miles_megatron")
sys.path.insert(0, SUPPORT)


def _rank(rank: int, world: int, port: int, hf_dir: str, save: str, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    try:
        sys.path.insert(0, SUPPORT)
        import torch.distributed as dist
        from backend_reference import run_backend

        torch.cuda.set_device(rank)
        dist.init_process_group("nccl")
        result = run_backend(hf_dir, save, tp=world)
        dist.destroy_process_group()
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001  (reported to the parent)
        queue.put((rank, "error", traceback.format_exc()))


def test_train_matches_hf_adamw_and_resumes_at_tp1(tmp_path):
    from backend_reference import check
    from megatron_tiny_models import make_tiny_hf

    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    world = min(2, torch.cuda.device_count())
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        ctx.Process(target=_rank, args=(r, world, port, hf_dir, str(tmp_path / "ckpt"), queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = {}
    for _ in range(world):
        rank, status, value = queue.get(timeout=500)
        assert status == "ok", value
        results[rank] = value
    for p in procs:
        p.join(timeout=30)
    check([results[r] for r in range(world)], hf_dir, device="cuda")
