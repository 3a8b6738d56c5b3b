"""megatron-core parallel state from the parallel-size flags: TP x PP x CP x EP x ETP, DP = rest.

The process group (NCCL on GPUs, gloo on CPUs) is set up by the caller (the launcher's Ray
actor or ``torchrun``); :func:`initialize_parallel` only carves megatron's groups out of it.

megatron's parallel state is one per process: the actor and the critic (``--use-critic``) of a
rank share it. :func:`acquire_parallel` joins the state a live backend built when the layout is
the same (else refuses), :func:`release_parallel` destroys it when its last user lets go.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from miles_core.args.checks import flag_value
from miles_core.args.parsed import ParsedArgs
from torch.distributed.distributed_c10d import _world

from miles_megatron.args import check_parallel_sizes

#: the process groups megatron created in :func:`initialize_parallel`, destroyed by
#: :func:`destroy_parallel` (megatron's own ``destroy_model_parallel`` only forgets them, so every
#: re-initialisation in one process would keep the old NCCL communicators and their buffers)
_OWN_GROUPS: list = []
#: backends using the current state (:func:`acquire_parallel` / :func:`release_parallel`)
_USERS: list[tuple[int, ...]] = []

_SIZE_FLAGS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)


def _registered_groups() -> list:
    return list(_world.pg_map)


def initialize_parallel(
    args: ParsedArgs, model_args: dict | None = None, timeout_s: float = 600
) -> None:
    """Validate the layout against the real world size, then build megatron's groups and seeds."""
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
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)


def destroy_parallel() -> None:
    """Forget megatron's groups and destroy the process groups it created (every rank calls
    this together, as it called :func:`initialize_parallel`: NCCL teardown waits for peers)."""
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    for group in reversed(_OWN_GROUPS):
        if group in _registered_groups():
            dist.destroy_process_group(group)
    _OWN_GROUPS.clear()


def _layout(args: ParsedArgs) -> tuple[int, ...]:
    return tuple(int(flag_value(args, f) or 0) for f in _SIZE_FLAGS)


def acquire_parallel(args: ParsedArgs, model_args: dict | None = None) -> None:
    """A backend's :func:`initialize_parallel`: the first user builds the state; a second
    backend in the process (the critic beside the actor) joins it, with the same layout, and
    reseeds megatron's RNG tracker as a first init would."""
    layout = _layout(args)
    if _USERS and ps.model_parallel_is_initialized():
        if layout != _USERS[0]:
            raise ValueError(
                f"megatron parallel state: this process runs layout {_USERS[0]} "
                f"({', '.join(_SIZE_FLAGS)}); a second backend asked for {layout}"
            )
        _USERS.append(layout)
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
        return
    _USERS.clear()
    initialize_parallel(args, model_args)
    _USERS.append(layout)


def release_parallel() -> None:
    """A backend's close: the state is destroyed when no other backend uses it."""
    if _USERS:
        _USERS.pop()
    if not _USERS:
        destroy_parallel()
