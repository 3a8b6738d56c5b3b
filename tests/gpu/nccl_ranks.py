"""GPU test support: run a test-support function on N spawned ranks, one GPU each, over NCCL.

``run_ranks(world, "module:function", *args)`` calls ``function(rank, world, *args)`` on every
rank (the module is imported from tests/miles_megatron, the support of the CPU tests whose
checks the GPU tests repeat) and returns every rank's result, or fails with the first rank's
traceback.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import socket
import sys
import traceback
from pathlib import Path

import torch

SUPPORT = str(Path(__file__).parents[1] / "miles_megatron")


def _rank(rank: int, world: int, port: int, target: str, args: tuple, queue) -> None:
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

        module, name = target.split(":")
        fn = getattr(importlib.import_module(module), name)
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl")
        result = fn(rank, world, *args)
        dist.destroy_process_group()
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001  (reported to the parent)
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(world: int, target: str, *args, timeout: float = 600) -> list:
    """``target(rank, world, *args)`` on ``world`` GPUs; every rank's result, in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        ctx.Process(target=_rank, args=(r, world, port, target, args, queue)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results = {}
    for _ in range(world):
        rank, status, value = queue.get(timeout=timeout)
        assert status == "ok", value
        results[rank] = value
    for p in procs:
        p.join(timeout=30)
    return [results[r] for r in range(world)]
