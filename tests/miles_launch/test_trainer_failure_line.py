"""A trainer rank's failed wake reaches the launcher as one line naming the rank, its host, the
contract method and WakeFailed's own message (phase, role, stage, bytes): the error survives
the pickling that carries it out of the rank's process."""

from __future__ import annotations

import pickle

import torch
from miles_launch.trainer_group import TrainerGroup
from miles_offload.allocation import AllocationFailed, WakeFailed


def test_a_failed_wake_is_one_trainer_rank_line():
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB")
    error = WakeFailed(
        "actor", "optimizer state", AllocationFailed("opt.exp_avg", 3 << 29, oom), None
    )
    carried = pickle.loads(pickle.dumps(error))  # as a rank's error leaves its process
    assert type(carried) is WakeFailed and str(carried) == str(error)
    assert (carried.role, carried.stage, carried.key, carried.nbytes) == (
        "actor", "optimizer state", "opt.exp_avg", 3 << 29,
    )  # fmt: skip
    group = TrainerGroup.__new__(TrainerGroup)  # no actors: only the line is made
    group.hosts = ["10.0.0.5"]
    line = group._failure_line(0, "wake_up", carried)
    assert line == (
        "trainer rank 0 on 10.0.0.5 failed in wake_up(): WakeFailed: wake of actor failed "
        "allocating its optimizer state (opt.exp_avg): 1.50 GiB (1610612736 bytes) asked; the "
        "state stays asleep and a later wake can retry (OutOfMemoryError: CUDA out of memory. "
        "Tried to allocate 1.50 GiB)"
    )
