"""Optional profiling of training steps.

* ``--use-pytorch-profiler``: ``torch.profiler`` records the optimizer steps
  ``[--profile-step-start, --profile-step-end)`` (global step indices from 0, whatever the
  rollouts they fall in); the trace is written to ``--tensorboard-dir`` (Chrome/TensorBoard
  format, one file per rank) or ``./profiler``.
* ``--record-memory-history``: CUDA allocator history is recorded over the same steps and a
  snapshot written to ``--memory-snapshot-path`` (per-rank suffix) when the window ends, at
  ``close()``, or when a rollout raises inside the window.
* ``--tensorboard-dir``: scalar metrics of every rollout, when ``tensorboard`` is installed.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from miles_core.args.parsed import ParsedArgs


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def memory_snapshot_path(args: ParsedArgs) -> Path:
    """``--memory-snapshot-path`` with this rank's suffix (``snap.pickle`` -> ``snap.rank0.pickle``)."""
    path = Path(args.memory_snapshot_path)
    return path.with_name(f"{path.stem}.rank{_rank()}{path.suffix}")


class TrainProfiler:
    """Start/stop the profilers around optimizer steps, keyed on the global optimizer step.

    :meth:`before_step` / :meth:`after_step` wrap every optimizer step (``step`` = the index of
    the step about to run, counted from 0 over the whole run); :meth:`log` writes a rollout's
    scalars; :meth:`stop` ends an open trace and dumps and stops the memory history (also at
    :meth:`close` and when a rollout raises, so a crash inside the window still leaves its
    snapshot).
    """

    def __init__(self, args: ParsedArgs) -> None:
        self.args = args
        self.profiler: torch.profiler.profile | None = None
        self.recording_memory = False
        self.writer = None
        if args.tensorboard_dir:
            try:
                # optional: tensorboard is a dependency of miles-launch, not of miles-fsdp
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(os.path.join(args.tensorboard_dir, f"rank{_rank()}"))
            except ImportError:
                if _rank() == 0:
                    print("miles-fsdp: tensorboard not installed, scalars not written", flush=True)

    def in_window(self, step: int) -> bool:
        return self.args.profile_step_start <= step < self.args.profile_step_end

    def before_step(self, step: int) -> None:
        """Optimizer step ``step`` is about to run: start what the window asks for."""
        args = self.args
        if not self.in_window(step):
            return
        if args.use_pytorch_profiler and self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            out = args.tensorboard_dir or "profiler"
            self.profiler = torch.profiler.profile(
                activities=activities,
                record_shapes=True,
                profile_memory=True,
                with_stack=False,
                on_trace_ready=torch.profiler.tensorboard_trace_handler(out, f"rank{_rank()}"),
            )
            self.profiler.__enter__()
        if args.record_memory_history and not self.recording_memory and torch.cuda.is_available():
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
            self.recording_memory = True

    def after_step(self, step: int) -> None:
        """Optimizer step ``step`` finished: stop at the end of the window."""
        if step + 1 >= self.args.profile_step_end:
            self.stop()

    def stop(self) -> None:
        """End the trace (written by its handler) and dump then stop the memory history."""
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            self.profiler = None
        if self.recording_memory:
            torch.cuda.memory._dump_snapshot(str(memory_snapshot_path(self.args)))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.recording_memory = False

    def log(self, global_step: int, metrics: dict[str, float]) -> None:
        """A rollout's metrics as ``train/<key>`` scalars at ``global_step``."""
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(f"train/{key}", value, global_step)
            self.writer.flush()

    def close(self) -> None:
        self.stop()
        if self.writer is not None:
            self.writer.close()
            self.writer = None
