"""Whole tensors of FSDP2-sharded values, gathered by a blocking collective (tests' read-outs).

FSDP2 shards a parameter (its gradient, its optimizer state) along dim 0 the way
``torch.chunk`` does: rank ``r`` holds rows ``[r*c, min((r+1)*c, n))`` with
``c = ceil(n / world)``. :func:`full` pads each rank's rows to ``c``, gathers them with
``dist.all_gather_into_tensor`` and trims to ``n``: the values ``DTensor.full_tensor()`` gives.

Why not ``full_tensor()``: on gloo it goes through torch's asynchronous functional
collectives, and one CI run's rank died of a SIGSEGV in a C++ thread during that path (in
``ema_program``'s first read-out; 60 repeats of the test did not reproduce it). The tests
read out thousands of tensors; the blocking collective keeps the read-out off that path.
Layouts other than one mesh dimension sharded on dim 0 still use ``full_tensor()``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


@torch.no_grad()
def full(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or the whole tensor of a DTensor (see the module docstring), outside
    autograd."""
    if not isinstance(t, DTensor):
        return t
    if t.device_mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
        return t.full_tensor()
    group = t.device_mesh.get_group()
    world = dist.get_world_size(group)
    rows = t.shape[0]
    chunk = -(-rows // world)
    local = t.to_local().detach()
    padded = local.new_zeros(chunk, *t.shape[1:])
    padded[: local.shape[0]] = local
    out = local.new_empty(chunk * world, *t.shape[1:])
    dist.all_gather_into_tensor(out, padded, group=group)
    return out[:rows]
