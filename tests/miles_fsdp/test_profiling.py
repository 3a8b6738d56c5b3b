"""--use-pytorch-profiler traces exactly the optimizer steps [--profile-step-start,
--profile-step-end), across rollout boundaries, and writes one trace per rank to
--tensorboard-dir; --tensorboard-dir receives every rollout's metrics as scalars (read back with
TensorBoard's own reader). --record-memory-history: recorded over the window, then dumped and
stopped at its end, at close() or when a rollout raises (torch.cuda's calls stood in for on the
CPU; the real dump is the CUDA test)."""

from __future__ import annotations

import json

import pytest
import torch
from miles_fsdp.profiling import TrainProfiler
from run_args import make_args


def rollout_work(size: int) -> None:
    a = torch.ones(size, size)
    torch.mm(a, a)


@pytest.mark.slow  # the profiler and TensorBoard imports take seconds
def test_profiler_window_counts_optimizer_steps_and_scalars(tmp_path):
    """Two rollouts of two optimizer steps (global steps 0..3), window [1, 3): the trace starts
    in the first rollout's second step and ends after the second rollout's first step."""
    tb = tmp_path / "tb"
    args = make_args(
        use_pytorch_profiler=True,
        profile_step_start=1,
        profile_step_end=3,
        tensorboard_dir=str(tb),
    )
    profiler = TrainProfiler(args)
    active = []
    step = 0
    for rollout in range(2):
        for _ in range(2):
            profiler.before_step(step)
            active.append(profiler.profiler is not None)
            rollout_work(10 + step)
            profiler.after_step(step)
            step += 1
        profiler.log(step, {"loss": 0.5 * rollout, "lr": 1e-3})
    profiler.close()
    assert active == [False, True, True, False]
    traces = sorted(tb.glob("rank0*.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    sizes = {e["args"]["Input Dims"][0][0] for e in events if e.get("name") == "aten::mm"}
    assert sizes == {11, 12}  # the work of steps 1 and 2 only

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb / "rank0"))
    acc.Reload()
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert loss == [(2, 0.0), (4, 0.5)]
    assert [e.step for e in acc.Scalars("train/lr")] == [2, 4]


def test_profiler_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    profiler = TrainProfiler(make_args(profile_step_start=0, profile_step_end=5))
    profiler.before_step(0)
    assert profiler.profiler is None and profiler.writer is None
    profiler.after_step(0)
    profiler.log(1, {"loss": 1.0})
    profiler.close()
    assert list(tmp_path.iterdir()) == []


class CudaMemoryCalls:
    """Stands in for torch.cuda's memory-history calls (the CUDA-only end of the code path)."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", self.record)
        monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", self.dump)

    def record(self, enabled="all", **kwargs):
        self.calls.append(("record", enabled))

    def dump(self, path):
        self.calls.append(("dump", path))


def memory_args(tmp_path, end=5):
    return make_args(
        record_memory_history=True,
        profile_step_start=0,
        profile_step_end=end,
        memory_snapshot_path=str(tmp_path / "snap.pickle"),
    )


def test_memory_history_window_and_close(tmp_path, monkeypatch):
    cuda = CudaMemoryCalls(monkeypatch)
    snapshot = str(tmp_path / "snap.rank0.pickle")
    profiler = TrainProfiler(memory_args(tmp_path, end=2))
    for step in range(3):
        profiler.before_step(step)
        profiler.after_step(step)
    assert cuda.calls == [("record", "all"), ("dump", snapshot), ("record", None)]

    cuda.calls.clear()  # the run closes inside the window: stopped and dumped at close()
    profiler = TrainProfiler(memory_args(tmp_path))
    profiler.before_step(0)
    profiler.after_step(0)
    assert cuda.calls == [("record", "all")]
    profiler.close()
    profiler.close()
    assert cuda.calls == [("record", "all"), ("dump", snapshot), ("record", None)]


def test_memory_history_dumped_when_a_rollout_raises(tmp_path, monkeypatch):
    import miles_fsdp.train_step as train_step
    from miles_fsdp.backend import FSDPBackend

    cuda = CudaMemoryCalls(monkeypatch)
    profiler = TrainProfiler(memory_args(tmp_path))

    def failing_rollout(ctx, batch):
        ctx.profiler.before_step(ctx.global_step)
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(train_step, "train_rollout", failing_rollout)
    backend = FSDPBackend()
    backend.profiler = profiler
    backend._rollout_context = lambda: train_step.RolloutContext(
        *[None] * 9, profiler=profiler, global_step=0
    )
    with pytest.raises(RuntimeError, match="out of memory"):
        backend.train(0, batch=None)
    snapshot = str(tmp_path / "snap.rank0.pickle")
    assert cuda.calls == [("record", "all"), ("dump", snapshot), ("record", None)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA memory history")
def test_memory_snapshot_written_at_window_end(tmp_path):
    profiler = TrainProfiler(memory_args(tmp_path, end=1))
    profiler.before_step(0)
    torch.ones(1024, device="cuda")
    profiler.after_step(0)
    profiler.close()
    assert (tmp_path / "snap.rank0.pickle").stat().st_size > 0


class StepRecorder:
    """A TrainProfiler stand-in recording the calls the training loop makes."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def before_step(self, step):
        self.calls.append(("before", step))

    def after_step(self, step):
        self.calls.append(("after", step))

    def log(self, step, metrics):
        self.calls.append(("log", step))

    def stop(self):
        self.calls.append(("stop", -1))

    def close(self):
        pass


@pytest.mark.slow
def test_training_loop_brackets_every_optimizer_step(one_rank_group, tmp_path):
    """Two rollouts of --num-steps-per-rollout 2: the profiler sees global steps 0..3."""
    from miles_core.batch import RolloutBatch
    from miles_fsdp.backend import FSDPBackend
    from samples import make_samples
    from tiny_models import save_tiny_model

    hf_dir = save_tiny_model(tmp_path / "m")
    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=str(hf_dir), num_steps_per_rollout=2))
    backend.profiler = recorder = StepRecorder()
    for rollout_id in range(2):
        backend.train(rollout_id, RolloutBatch(make_samples(seed=rollout_id)))
    backend.close()
    steps = [("before", 0), ("after", 0), ("before", 1), ("after", 1), ("log", 2)]
    steps += [("before", 2), ("after", 2), ("before", 3), ("after", 3), ("log", 4)]
    assert recorder.calls == steps
