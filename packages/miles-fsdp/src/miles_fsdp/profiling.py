"""Optional profiling of training steps.

* ``--use-pytorch-profiler``: ``torch.profiler`` records the rollouts whose first optimizer
  step falls in ``[--profile-step-start, --profile-step-end)``; the trace is written to
  ``--tensorboard-dir`` (Chrome/TensorBoard format, one file per rank) or ``./profiler``.
* ``--record-memory-history``: CUDA allocator history is recorded from the start step and a
  snapshot written to ``--memory-snapshot-path`` (per-rank suffix) at the end step.
* ``--tensorboard-dir``: scalar metrics of every rollout, when ``tensorboard`` is installed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class TrainProfiler:
    """Start/stop the profilers around :meth:`FSDPBackend.train` calls, keyed on global step."""

    def __init__(self, args: Any) -> None:
        self.args = args
        self.profiler: torch.profiler.profile | None = None
        self.recording_memory = False
        self.writer = None
        if args.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(os.path.join(args.tensorboard_dir, f"rank{_rank()}"))
            except ImportError:
                if _rank() == 0:
                    print("miles-fsdp: tensorboard not installed, scalars not written", flush=True)

    def before(self, global_step: int) -> None:
        args = self.args
        in_window = args.profile_step_start <= global_step < args.profile_step_end
        if args.use_pytorch_profiler and in_window and self.profiler is None:
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
        if args.record_memory_history and in_window and not self.recording_memory:
            if torch.cuda.is_available():
                torch.cuda.memory._record_memory_history(max_entries=1_000_000)
                self.recording_memory = True

    def after(self, global_step: int, metrics: dict[str, float]) -> None:
        args = self.args
        if self.profiler is not None and global_step >= args.profile_step_end:
            self.profiler.__exit__(None, None, None)
            self.profiler = None
        if self.recording_memory and global_step >= args.profile_step_end:
            path = Path(args.memory_snapshot_path)
            path = path.with_name(f"{path.stem}.rank{_rank()}{path.suffix}")
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.recording_memory = False
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(f"train/{key}", value, global_step)
            self.writer.flush()

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            self.profiler = None
        if self.writer is not None:
            self.writer.close()
