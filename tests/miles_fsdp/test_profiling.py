"""--use-pytorch-profiler traces exactly the rollouts whose first optimizer step falls in
[--profile-step-start, --profile-step-end) and writes one trace per rank to --tensorboard-dir;
--tensorboard-dir receives every rollout's metrics as scalars (read back with TensorBoard's
own reader). --record-memory-history needs CUDA: on a CPU it records nothing."""

from __future__ import annotations

import json

import pytest
import torch
from miles_fsdp.profiling import TrainProfiler
from run_args import make_args


def rollout_work(tag: int) -> None:
    a = torch.full((16, 16), float(tag))
    torch.mm(a, a)


@pytest.mark.slow  # the profiler and TensorBoard imports take seconds
def test_profiler_window_trace_and_scalars(tmp_path):
    tb = tmp_path / "tb"
    args = make_args(
        use_pytorch_profiler=True,
        profile_step_start=1,
        profile_step_end=3,
        tensorboard_dir=str(tb),
        record_memory_history=True,
        memory_snapshot_path=str(tmp_path / "snap.pickle"),
    )
    profiler = TrainProfiler(args)
    active = []
    step = 0
    for rollout in range(4):  # one optimizer step per rollout: global steps 0, 1, 2, 3
        profiler.before(step)
        active.append(profiler.profiler is not None)
        rollout_work(rollout)
        step += 1
        profiler.after(step, {"loss": 0.5 * rollout, "lr": 1e-3})
    profiler.close()
    assert active == [False, True, True, False]
    traces = sorted(tb.glob("rank0*.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)
    assert not (tmp_path / "snap.rank0.pickle").exists()  # no CUDA: no memory history

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb / "rank0"))
    acc.Reload()
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert loss == [(1, 0.0), (2, 0.5), (3, 1.0), (4, 1.5)]
    assert [e.step for e in acc.Scalars("train/lr")] == [1, 2, 3, 4]


def test_profiler_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    profiler = TrainProfiler(make_args(profile_step_start=0, profile_step_end=5))
    profiler.before(0)
    assert profiler.profiler is None and profiler.writer is None
    profiler.after(1, {"loss": 1.0})
    profiler.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA memory history")
def test_memory_snapshot_written_at_window_end(tmp_path):
    args = make_args(
        record_memory_history=True,
        profile_step_start=0,
        profile_step_end=1,
        memory_snapshot_path=str(tmp_path / "snap.pickle"),
    )
    profiler = TrainProfiler(args)
    profiler.before(0)
    torch.ones(1024, device="cuda")
    profiler.after(1, {})
    profiler.close()
    assert (tmp_path / "snap.rank0.pickle").stat().st_size > 0
