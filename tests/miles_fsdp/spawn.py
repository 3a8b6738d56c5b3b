"""Run a function on N gloo ranks (forked from a forkserver that imported torch and the
backends: ``tests/rank_context.py``) with a timeout."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable

import torch.distributed as dist
import torch.multiprocessing as mp
from rank_context import in_environ, rank_context, start_method
from timeouts import scaled


def _entry(
    rank: int, world_size: int, init_file: str, backend: str, fn: Callable, args: tuple
) -> None:
    import faulthandler

    faulthandler.enable()  # a rank killed by a signal prints its Python stack to stderr
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["LOCAL_RANK"] = str(rank)
    import torch

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown. After FSDP2 ran on a gloo mesh, the group's
    # worker threads outlive destroy_process_group (torch keeps the group once a device mesh
    # used it), and a worker that drops its last finished work while the interpreter finalises
    # needs the GIL for that work's tensors: the thread exits inside a destructor and the rank
    # aborts ("terminate called without an active exception", SIGABRT) after its work was
    # done, about one spawn in 30.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(
    world_size: int,
    fn: Callable,
    *args,
    timeout: float = 120.0,
    backend: str = "gloo",
    shared_memory: bool = False,
) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` ranks; raise if any fails.

    ``backend="nccl"`` pins rank ``r`` to GPU ``r`` (tests/gpu). ``shared_memory``: the ranks
    share CPU tensors with another process (an ``ipc`` publish): their ``torch_shm_manager``
    inherits the exit pipe that ``join`` waits on, so the exit codes are polled instead (a
    failing rank's traceback is on stderr).
    """
    timeout = scaled(timeout)
    with tempfile.TemporaryDirectory() as tmp:
        rank_context(backend)
        ctx = mp.start_processes(
            in_environ(_entry),
            args=(world_size, os.path.join(tmp, "init"), backend, fn, args),
            nprocs=world_size,
            join=False,
            start_method=start_method(backend),
        )
        import time

        deadline = time.monotonic() + timeout
        if shared_memory:
            while any(p.exitcode is None for p in ctx.processes):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    raise TimeoutError(f"{world_size}-rank run did not finish within {timeout}s")
                time.sleep(0.2)
            codes = [p.exitcode for p in ctx.processes]
            if codes != [0] * world_size:
                raise RuntimeError(f"{world_size}-rank run exited with {codes}")
            return
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{world_size}-rank run did not finish within {timeout}s")


def run_in_sequence(rank: int, world_size: int, calls: list[tuple[Callable, tuple]]) -> None:
    """A rank program that calls each ``fn(rank, world_size, *args)`` of ``calls`` in turn:
    tests that need the same ranks share one spawn (``run_ranks(n, run_in_sequence, calls)``)."""
    for fn, args in calls:
        fn(rank, world_size, *args)


def gather_to_file(result, out_file: str) -> None:
    """Collective: every rank's ``result`` (JSON-able), as a list in rank order, written to
    ``out_file`` by rank 0 (what a spawned test program hands back to its test)."""
    import json

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        with open(out_file, "w") as f:
            json.dump(gathered, f)
