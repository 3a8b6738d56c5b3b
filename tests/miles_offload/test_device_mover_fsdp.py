"""DeviceMover on FSDP2-sharded models: 2 gloo ranks on a CPU mesh, uneven shards, tied embeddings."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from miles_core.ports import free_port
from miles_offload.device_mover import DeviceMover
from miles_offload.offload_target import OffloadTarget
from offload_fsdp_model import build, train_step
from torch.distributed.tensor import DTensor

WORLD = 2


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _snapshot(model, opt):
    params = {n: _local(p).clone() for n, p in model.named_parameters()}
    padded = {}
    from miles_offload.state_tensors import fsdp_params_by_id

    for n, p in model.named_parameters():
        fp = fsdp_params_by_id(model)[id(p)]
        padded[n] = fp._sharded_param_data.clone()
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    state = {
        (i, k): _local(v).clone()
        for i, p in enumerate(opt.param_groups[0]["params"])
        for k, v in opt.state[p].items()
    }
    return params, padded, buffers, state


def _assert_same(a, b):
    for part_a, part_b in zip(a, b):
        assert part_a.keys() == part_b.keys()
        for k in part_a:
            assert part_a[k].dtype == part_b[k].dtype and part_a[k].shape == part_b[k].shape, k
            assert torch.equal(part_a[k], part_b[k]), k


def _round_trip(rank: int, disk_dir: str) -> None:
    model = build(0, shard=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt, 0, rank)
    before = _snapshot(model, opt)
    param_ids = [id(p) for p in model.parameters()]
    group_ids = [id(p) for p in opt.param_groups[0]["params"]]
    state_keys = [id(p) for p in opt.state]
    # rank 1 really holds uneven and empty shards
    lin1 = model.layers[0].lin1.weight
    assert _local(lin1).shape[0] == (4 if rank == 0 else 3)
    assert _local(model.extra).shape[0] == (1 if rank == 0 else 0)

    for kind in ("cpu", "disk"):
        mover = DeviceMover(
            {"actor": model}, [opt], OffloadTarget(kind=kind, disk_dir=disk_dir, chunk_mb=1)
        )
        for _cycle in range(2):
            old_ptr = _local(lin1).data_ptr()
            mover.sleep()
            mover.sleep()  # idempotent
            assert mover.is_asleep
            assert all(p.grad is None for p in model.parameters())
            if kind == "cpu":
                store = mover._groups[0].store
                for p in model.parameters():
                    if _local(p).numel():
                        assert store.owns(_local(p)), "parameter not in the arena"
                assert _local(lin1).data_ptr() != old_ptr
                assert torch.equal(_local(lin1), before[0]["layers.0.lin1.weight"])
            else:
                assert _local(lin1).untyped_storage().nbytes() == 0  # device memory freed
                assert all(os.path.exists(p) for p in mover.disk_paths)
            mover.wake_up()
            mover.wake_up()
            assert not mover.is_asleep
            _assert_same(before, _snapshot(model, opt))
            assert [id(p) for p in model.parameters()] == param_ids
            assert [id(p) for p in opt.param_groups[0]["params"]] == group_ids
            assert [id(p) for p in opt.state] == state_keys
            assert model.head.weight is model.embed.weight
        paths = mover.disk_paths
        mover.close()
        assert not any(os.path.exists(p) for p in paths)


def _training_equal(rank: int, disk_dir: str) -> None:
    reference = build(1, shard=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for kind in ("cpu", "disk"):
        model = build(1, shard=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mover = DeviceMover(
            {"actor": model}, [opt], OffloadTarget(kind=kind, disk_dir=disk_dir, chunk_mb=1)
        )
        mover.sleep()  # before the first step: no optimizer state yet
        mover.wake_up()
        for step in range(3):
            train_step(model, opt, step, rank)
            mover.sleep()
            mover.wake_up()
        train_step(model, opt, 3, rank)
        mover.close()
        if kind == "cpu":
            for step in range(4):
                train_step(reference, ref_opt, step, rank)
        _assert_same(_snapshot(reference, ref_opt), _snapshot(model, opt))


def _frozen(rank: int, disk_dir: str) -> None:
    actor = build(2, shard=True)
    ref = build(3, shard=True)
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-2)
    train_step(actor, opt, 0, rank)
    ref_before = {n: _local(p).clone() for n, p in ref.named_parameters()}
    mover = DeviceMover({"actor": actor, "ref": ref}, [opt], frozen={"ref"})
    first = mover.sleep()
    ref_ptrs = [_local(p).data_ptr() for p in ref.parameters()]
    mover.wake_up()
    assert mover._groups[1].store.holds_current  # the pinned copy is kept after waking
    train_step(actor, opt, 1, rank)
    second = mover.sleep()
    # the frozen model was pointed back at its copy: same host addresses, no bytes copied
    assert [_local(p).data_ptr() for p in ref.parameters()] == ref_ptrs
    ref_bytes = sum(_local(p).numel() * 4 for p in ref.parameters())
    assert ref_bytes > 0 and first.bytes_copied - second.bytes_copied >= ref_bytes - 64
    mover.wake_up()
    for n, p in ref.named_parameters():
        assert torch.equal(_local(p), ref_before[n]), n
    mover.close()


def _worker(rank: int, port: int, disk_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        _round_trip(rank, disk_dir)
        _training_equal(rank, disk_dir)
        _frozen(rank, disk_dir)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp2_two_ranks():
    """One spawn (importing torch dominates) runs the three scenarios on both ranks:
    round trips (cpu and disk), training after 3 cycles equal to training without, and a
    frozen model re-slept without a copy."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(free_port(), d), nprocs=WORLD, join=True)
