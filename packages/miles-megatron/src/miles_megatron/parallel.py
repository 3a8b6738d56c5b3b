"""megatron-core parallel state from the parallel-size flags: TP x PP x CP x EP x ETP, DP = rest.

The process group (NCCL on GPUs, gloo on CPUs) is set up by the caller (the launcher's Ray
actor or ``torchrun``); :func:`initialize_parallel` only carves megatron's groups out of it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from miles_megatron.args import check_parallel_sizes

#: the process groups megatron created in :func:`initialize_parallel`, destroyed by
#: :func:`destroy_parallel` (megatron's own ``destroy_model_parallel`` only forgets them, so every
#: re-initialisation in one process would keep the old NCCL communicators and their buffers)
_OWN_GROUPS: list = []


def _registered_groups() -> list:
    from torch.distributed.distributed_c10d import _world

    return list(_world.pg_map)


def initialize_parallel(args: Any, model_args: dict | None = None, timeout_s: float = 600) -> None:
    """Validate the layout against the real world size, then build megatron's groups and seeds."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not dist.is_initialized():
        raise RuntimeError("initialize_parallel: torch.distributed is not initialised")
    check_parallel_sizes(args, dist.get_world_size(), model_args)
    destroy_parallel()
    before = set(_registered_groups())
    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size
        or args.tensor_model_parallel_size,
        distributed_timeout_minutes=max(1, int(timedelta(seconds=timeout_s).total_seconds() // 60)),
    )
    _OWN_GROUPS[:] = [g for g in _registered_groups() if g not in before]
    tensor_parallel.model_parallel_cuda_manual_seed(getattr(args, "seed", 1234))


def destroy_parallel() -> None:
    """Forget megatron's groups and destroy the process groups it created (every rank calls
    this together, as it called :func:`initialize_parallel`: NCCL teardown waits for peers)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    for group in reversed(_OWN_GROUPS):
        if group in _registered_groups():
            dist.destroy_process_group(group)
    _OWN_GROUPS.clear()
