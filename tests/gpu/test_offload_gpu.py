"""DeviceMover on a CUDA device: real async copies, uneven FSDP shards, memory returned.

Skipped without CUDA (tests/conftest.py). Run on a GPU node with
``uv run pytest tests/gpu/test_offload_gpu.py``.
"""

from __future__ import annotations

import os

import miles_native
import pytest
import torch
import torch.distributed as dist
from miles_core.ports import free_port
from miles_offload.device_mover import DeviceMover
from torch.distributed.tensor import DTensor

pytestmark = pytest.mark.gpu


def _local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


@pytest.fixture
def one_rank_group():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_copy_engine_uses_cuda_and_arena_is_pinned():
    assert miles_native.cuda_runtime_available()
    engine = miles_native.CopyEngine(device=torch.cuda.current_device())
    assert engine.uses_cuda and engine.stream_to_host != 0
    arena = miles_native.PinnedArena(1 << 20)
    assert arena.pinned
    assert torch.frombuffer(arena, dtype=torch.uint8).is_pinned()


def test_uneven_shards_bit_identical_with_async_copies(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 37), torch.nn.Linear(37, 11)).cuda()
    mesh = init_device_mesh("cuda", (1,))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 64, device="cuda")).sum().backward()
    opt.step()
    before = [_local(p).clone() for p in model.parameters()]
    state = [_local(v).clone() for p in model.parameters() for k, v in opt.state[p].items()]
    ids = [id(p) for p in model.parameters()]
    mover = DeviceMover({"actor": model}, [opt])
    for _ in range(3):
        mover.sleep()
        assert all(_local(p).device.type == "cpu" for p in model.parameters())
        mover.wake_up()
        assert [id(p) for p in model.parameters()] == ids
        assert all(torch.equal(a, _local(b)) for a, b in zip(before, model.parameters()))
        after = [_local(v) for p in model.parameters() for k, v in opt.state[p].items()]
        assert all(torch.equal(a, b) for a, b in zip(state, after))
    mover.close()


def test_200_cycles_return_device_memory_and_keep_host_memory_constant():
    torch.cuda.empty_cache()
    baseline, _ = torch.cuda.mem_get_info()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 1024, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
    mover = DeviceMover({"actor": model}, [opt])
    mover.sleep()
    mover.wake_up()
    host = mover.host_bytes
    for _ in range(200):
        mover.sleep()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        assert abs(free - baseline) <= 0.01 * total
        assert mover.host_bytes == host
        mover.wake_up()
    mover.close()


def _segments_holding(tensors) -> set[int]:
    """Base addresses of the caching allocator's segments that hold ``tensors``."""
    segments = [
        (s["address"], s["address"] + s["total_size"]) for s in torch.cuda.memory_snapshot()
    ]
    found = set()
    for t in tensors:
        ptr = t.data_ptr()
        found.update(start for start, end in segments if start <= ptr < end)
    return found


def test_wake_carves_each_group_from_one_segment_and_sleep_returns_it():
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_reserved()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 1024, device="cuda")

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    reference = [p.detach().cpu() for p in model.parameters()]  # off the device: no gaps
    mover = DeviceMover({"actor": model}, [opt])
    mover.sleep()
    mover.wake_up()
    weights = [p for p in model.parameters() if p.nbytes > (1 << 20)]
    moments = [v for p in weights for v in opt.state[p].values() if v.nbytes > (1 << 20)]
    assert len(weights) == 8 and len(moments) == 16
    assert len(_segments_holding(weights)) == 1
    assert len(_segments_holding(moments)) == 1
    del weights, moments  # the next sleep replaces the state tensors: hold none of them
    assert all(torch.equal(a, b.cpu()) for a, b in zip(reference, model.parameters()))
    for _ in range(3):  # training between wake and sleep leaves nothing behind in the segments
        step()
        mover.sleep()
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() - baseline <= 4 << 20  # x and small-pool leftovers
        mover.wake_up()
    mover.close()
