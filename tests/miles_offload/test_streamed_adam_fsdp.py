"""StreamedAdamW on an FSDP2 model over 2 gloo ranks (CPU mesh), against torch AdamW.

The model (offload_fsdp_model.TinyLM) has uneven shards, an empty shard on rank 1 and tied
embeddings; with ``min_numel=8`` and ``bucket_numel=40`` most parameters are streamed and
several are split across buckets. Every rank sees the same batches, clipping is on.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from full_tensors import full
from miles_core.ports import free_port
from miles_offload.streamed_adam import StreamedAdamConfig, StreamedAdamW
from offload_fsdp_model import VOCAB, build
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import _get_scalar_dtype

WORLD = 2
LR, WD, BETAS, EPS, CLIP = 1e-2, 0.1, (0.9, 0.95), 1e-8, 0.5
MIN_NUMEL, BUCKET = 8, 40


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    return full(t).clone()


def _streamed(model, disk_dir, bucket=BUCKET, moment_dtype="fp32") -> StreamedAdamW:
    config = StreamedAdamConfig(
        disk_dir=disk_dir,
        moment_dtype=moment_dtype,
        bucket_numel=bucket,
        min_numel=MIN_NUMEL,
        chunk_mb=1,
        ring_chunks=2,
        foreach=True,
    )
    return StreamedAdamW(
        model.named_parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, config=config
    )


def _reference(model) -> torch.optim.AdamW:
    # the FSDP backend's CPU configuration: foreach
    return torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=True
    )


def _schedule(opt, restore: dict | None = None):
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    if restore is not None:
        sched.load_state_dict(restore)
        for group, lr in zip(opt.param_groups, sched.get_last_lr()):
            group["lr"] = lr
    return sched


def _train(model, opt, sched, step: int) -> None:
    g = torch.Generator().manual_seed(step)  # the same batch on every rank
    x = torch.randint(0, VOCAB, (3, 5), generator=g)
    y = torch.randint(0, VOCAB, (3, 5), generator=g)
    loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def _assert_matches(opt: StreamedAdamW, model, ref, ref_model) -> None:
    """Parameters and every state tensor (this rank's shard) bitwise equal to torch AdamW's."""
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(_local(p), _local(q)), name
        rs = ref.state[q]
        if p.numel() >= MIN_NUMEL:
            st = opt.read_state(name)
            assert torch.equal(st["master"], _local(q).reshape(-1)), name
            assert torch.equal(st["exp_avg"], _local(rs["exp_avg"]).reshape(-1)), name
            assert torch.equal(st["exp_avg_sq"], _local(rs["exp_avg_sq"]).reshape(-1)), name
        else:
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(_local(opt.state[p][key]), _local(rs[key])), name


def _scenarios(rank: int, d: str) -> None:
    work, ckpt = os.path.join(d, "work"), os.path.join(d, "ckpt")
    ref_model, model, bf_model = build(0, shard=True), build(0, shard=True), build(0, shard=True)
    ref, opt, bf = (
        _reference(ref_model),
        _streamed(model, work),
        _streamed(bf_model, work, moment_dtype="bf16"),
    )
    assert len(opt.buckets) > 3 and any(len(b.segments) > 1 for b in opt.buckets)
    scheds = [_schedule(o) for o in (ref, opt, bf)]
    for step in range(1, 6):
        for m, o, s in zip((ref_model, model, bf_model), (ref, opt, bf), scheds):
            _train(m, o, s, step)
        _assert_matches(opt, model, ref, ref_model)
        if step == 3:
            opt.save(ckpt)
            at3 = {n: _local(p).clone() for n, p in ref_model.named_parameters()}
            sched3 = scheds[0].state_dict()
            full = {n: _full(p.detach()) for n, p in ref_model.named_parameters()}
            state = {
                n: {k: _full(v) for k, v in ref.state[p].items()}
                for n, p in ref_model.named_parameters()
            }
            if rank == 0:
                torch.save(
                    {"params": full, "state": state, "sched": sched3}, os.path.join(d, "step3.pt")
                )

    # bf16 moments: close to the fp32 reference, not equal
    for (name, p), q in zip(bf_model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(_local(p), _local(q), rtol=0, atol=5 * LR * 2**-5)
        if p.numel() >= MIN_NUMEL and _local(p).numel():
            want = _local(ref.state[q]["exp_avg_sq"]).reshape(-1)
            got = bf.read_state(name)["exp_avg_sq"].float()
            torch.testing.assert_close(got, want, rtol=2**-6, atol=1e-3 * want.abs().max().item())

    # resume on the same 2 ranks (same and different bucket size): bitwise the same run
    for bucket in (BUCKET, 23):
        resumed = build(1, shard=True)
        with torch.no_grad():
            for n, p in resumed.named_parameters():
                _local(p).copy_(at3[n])
        opt2 = _streamed(resumed, os.path.join(d, f"work{bucket}"), bucket=bucket)
        opt2.load(ckpt)
        sched2 = _schedule(opt2, sched3)
        for step in (4, 5):
            _train(resumed, opt2, sched2, step)
        _assert_matches(opt2, resumed, ref, ref_model)
        opt2.close()
    for o in (opt, bf):
        o.close()


def _worker(rank: int, port: int, d: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        _scenarios(rank, d)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _one_rank_continuation(d: str) -> None:
    """Resume the 2-rank checkpoint on 1 rank (other buckets) == torch AdamW continuing there."""
    saved = torch.load(os.path.join(d, "step3.pt"))
    ref_model, model = build(2, shard=False), build(3, shard=False)
    with torch.no_grad():
        for m in (ref_model, model):
            for n, p in m.named_parameters():
                p.copy_(saved["params"][n])
    ref = _reference(ref_model)
    for n, p in ref_model.named_parameters():
        st = saved["state"][n]
        ref.state[p] = {
            "step": torch.tensor(float(st["step"]), dtype=_get_scalar_dtype()),
            "exp_avg": st["exp_avg"].clone(),
            "exp_avg_sq": st["exp_avg_sq"].clone(),
        }
    opt = _streamed(model, os.path.join(d, "work1"), bucket=64)
    opt.load(os.path.join(d, "ckpt"))
    assert opt.world_size == 1 and len(opt.buckets) != 0
    scheds = [_schedule(o, saved["sched"]) for o in (ref, opt)]
    for step in (4, 5):
        _train(ref_model, ref, scheds[0], step)
        _train(model, opt, scheds[1], step)
        _assert_matches(opt, model, ref, ref_model)
    opt.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp2_two_ranks_bitwise_resume_and_one_rank_continuation():
    """One spawn runs: fp32 bitwise vs torch AdamW over 5 steps, bf16 tolerance, same-topology
    resume (two bucket sizes); then this process resumes the 2-rank checkpoint on 1 rank."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(free_port(), d), nprocs=WORLD, join=True)
        assert sorted(os.listdir(os.path.join(d, "ckpt"))) == ["rank00000", "rank00001"]
        _one_rank_continuation(d)
