"""Test support: run a function on N spawned ranks: gloo with the megatron CPU shim installed
(the CPU tests), or NCCL with one GPU per rank (the GPU tests in tests/gpu, which repeat these
tests' checks at real sizes).

``spawn_ranks(fn, world_size, *args)`` returns every rank's return value (picklable) and
raises the first rank's error; a rank that does not finish within ``timeout`` seconds fails the
test instead of hanging it.
"""

from __future__ import annotations

import os
import queue as queue_module
import time
import traceback
from collections.abc import Callable
from typing import Any

from miles_core.ports import free_port
from rank_context import in_environ, rank_context
from timeouts import scaled


def _entry(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable,
    args: tuple,
    queue,
    shim: bool,
    backend: str,
) -> None:
    import faulthandler

    faulthandler.enable()  # a rank killed by a signal prints its Python stack to stderr
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    if backend == "gloo":
        os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import sys

        import torch
        import torch.distributed as dist

        sys.path.insert(0, os.path.dirname(__file__))
        import megatron_shim

        if backend == "nccl":
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(1)
        if shim:
            megatron_shim.install()
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        try:
            result = fn(rank, world_size, *args)
        finally:
            from megatron.core import parallel_state as ps

            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
            dist.destroy_process_group()
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001  (reported to the parent)
        queue.put((rank, "error", traceback.format_exc()))


def spawn_ranks(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = 180,
    shim: bool = True,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return their results.

    ``shim=False`` leaves torch as it is (for code that is not megatron-core, e.g. FSDP).
    ``backend="nccl"``: rank ``r`` on GPU ``r``, no shim (megatron-core's CUDA paths are real).
    """
    if backend == "nccl" and shim:
        raise ValueError("the megatron CPU shim is for gloo ranks: pass shim=False with nccl")
    ctx = rank_context(backend)
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=in_environ(_entry),
            args=(r, world_size, port, fn, args, queue, shim, backend),
            daemon=False,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    timeout = scaled(timeout)
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            try:
                rank, status, value = queue.get(timeout=1.0)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and not set(dead) <= set(results):
                    raise RuntimeError(f"rank(s) {dead} died without a result") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish within {timeout} s") from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
