"""What a run shows and records: the startup phases, progress bars (on a terminal only), one line
per rollout, TensorBoard, W&B, JSONL, and the closing summary of where everything is.

The per-rollout line (stdout)::

    rollout 3/12 | reward 0.412 | resp_len 7.9 | loss -0.0123 | kl 0.0001 | mismatch 0.0021 |
    version 4 | gen 1.20s train 0.80s save 0.00s update 0.10s

(``mismatch``: the mean |log-prob difference| between trainer and engine over the trained
tokens, :mod:`miles_core.mismatch`, when the engine returned log-probs.)

After a rollout that evaluated, one line per eval set::

    eval after rollout 3 | gsm8k | reward_mean 0.4000 | response_len_mean 7.5000 | pass@1 ...

The evaluation before training is the record of rollout -1, with ``eval`` and ``time.eval``
only: its lines read ``eval before training | ...``, TensorBoard and the JSONL file have it at
step -1, W&B (whose steps start at 0) at step 0.

Scalars go to TensorBoard under ``--tensorboard-dir`` (miles-core's reporting group) as
``rollout/<name>``, ``train/<name>``, ``time/<phase>`` (``time/eval`` included) and
``eval/<set>/<name>``; to W&B with ``--use-wandb`` when ``wandb`` is installed; and as one
JSON object per rollout to ``--metrics-jsonl`` (its ``eval`` object holds the metrics by set).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from contextlib import contextmanager
from typing import Any

from miles_core.args.parsed import ParsedArgs
from miles_core.args.run_config import group_from_namespace
from miles_core.checkpoint_layout import read_tracker
from miles_core.mismatch import ABS_DIFF
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from miles_launch.args import OutputArgs
from miles_launch.engine_launch.api_key import redact
from miles_launch.plan import log_dir, run_dir

logger = logging.getLogger(__name__)


#: When the command started (:func:`start_clock`): the phase lines count from it.
_STARTED = time.monotonic()


def start_clock(started: float | None = None) -> None:
    """Phases count from ``started`` (a ``time.monotonic()``; unset: now)."""
    global _STARTED
    _STARTED = time.monotonic() if started is None else started


def phase(line: str) -> None:
    """One startup phase on stdout, with the seconds since the command started:
    ``[  4.2s] trainer ready``."""
    tqdm.write(f"[{time.monotonic() - _STARTED:5.1f}s] {line}", file=sys.stdout)
    sys.stdout.flush()


def progress_on(output: OutputArgs) -> bool:
    """Progress bars: ``--progress`` (the default) and stderr a terminal; a log file or pipe
    gets the per-rollout lines only (a bar's carriage returns and ANSI codes would litter it)."""
    return output.progress and sys.stderr.isatty()


class Reporter:
    """The run's metrics, to the terminal, ``--metrics-jsonl``, TensorBoard (``tb_dir``,
    ``--tensorboard-dir``) and W&B (``wandb_config``: the flags it records, with ``--use-wandb``)."""

    def __init__(
        self,
        output: OutputArgs,
        tb_dir: str | None,
        num_rollout: int,
        wandb_config: dict[str, Any] | None = None,
    ):
        self.num_rollout = num_rollout
        self.show_progress = progress_on(output)
        self.jsonl_path = output.metrics_jsonl
        self.train_bar = None  # rollouts trained, made at the first record
        self.tb = None
        if tb_dir:
            self.tb = SummaryWriter(log_dir=tb_dir, filename_suffix=".miles-launch")
        self.wandb = None
        if output.use_wandb:
            try:
                import wandb  # optional dependency (--use-wandb)
            except ImportError:
                logger.warning("--use-wandb: wandb is not installed; logging to W&B is off")
            else:
                self.wandb = wandb.init(
                    project=output.wandb_project, name=output.wandb_run_name, config=wandb_config
                )

    @classmethod
    def from_args(cls, args: ParsedArgs, num_rollout: int) -> Reporter:
        """The reporter of the parsed (and maybe since updated) namespace ``args``."""
        output = group_from_namespace(OutputArgs, args)
        return cls(output, args.tensorboard_dir, num_rollout, public_config(args))

    # ------------------------------------------------------------------ progress
    @contextmanager
    def progress(self, desc: str, total: int):
        """A tqdm bar on stderr (a no-op object with ``--no-progress``): one per generation
        phase (samples done); a second bar counts the rollouts trained."""
        bar = tqdm(
            total=total,
            desc=desc,
            leave=False,
            file=sys.stderr,
            disable=not self.show_progress,
            dynamic_ncols=True,
        )
        try:
            yield bar
        finally:
            bar.close()

    def print(self, line: str) -> None:
        tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()

    # ------------------------------------------------------------------ per rollout
    def rollout(self, record: dict[str, Any]) -> None:
        """One rollout's record: the summary line, scalars and the JSONL line (the record of
        the evaluation before training: its eval lines, scalars and JSONL line)."""
        trained = "rollout" in record
        if trained:
            self.print(summary_line(record, self.num_rollout))
        for line in eval_lines(record):
            self.print(line)
        step = int(record["rollout_id"])
        if trained and self.train_bar is None:
            self.train_bar = tqdm(
                total=self.num_rollout,
                initial=step,
                desc="rollouts trained",
                file=sys.stderr,
                disable=not self.show_progress,
                dynamic_ncols=True,
            )
        if trained:
            self.train_bar.update(1)
        scalars = flatten_scalars(record)
        if self.tb is not None:
            for name, value in scalars.items():
                self.tb.add_scalar(name, value, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=max(step, 0))
        if self.jsonl_path:
            with open(self.jsonl_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")

    def close(self) -> None:
        if self.train_bar is not None:
            self.train_bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def summary_line(record: dict[str, Any], num_rollout: int) -> str:
    """The one-line summary of a rollout record (see the module docstring)."""
    r = record["rollout"]
    t = record.get("train", {})
    parts = [
        f"rollout {record['rollout_id'] + 1}/{num_rollout}",
        f"reward {r['reward_mean']:.3f}",
        f"resp_len {r['response_len_mean']:.1f}",
    ]
    if "loss" in t:
        parts.append(f"loss {t['loss']:.4f}")
    kl = t.get("ppo_kl", t.get("kl_loss"))
    if kl is not None:
        parts.append(f"kl {kl:.4f}")
    if ABS_DIFF in t:
        parts.append(f"mismatch {t[ABS_DIFF]:.4f}")
    if record.get("weight_version") is not None:
        parts.append(f"version {record['weight_version']}")
    if "staleness_mean" in r:
        parts.append(f"staleness {r['staleness_mean']:.2f}")
    times = " ".join(f"{k} {v:.2f}s" for k, v in record.get("time", {}).items())
    parts.append(times)
    return " | ".join(parts)


def eval_lines(record: dict[str, Any]) -> list[str]:
    """One line per eval set of ``record`` (none when it did not evaluate); the rollout is
    numbered from 1, as in the summary line."""
    rollout_id = record["rollout_id"]
    when = f"eval after rollout {rollout_id + 1}" if rollout_id >= 0 else "eval before training"
    return [
        " | ".join([when, name] + [f"{k} {v:.4f}" for k, v in metrics.items()])
        for name, metrics in record.get("eval", {}).items()
    ]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def flatten_scalars(record: dict[str, Any]) -> dict[str, float]:
    """``{"rollout/reward_mean": ..., "train/loss": ..., "time/gen": ...,
    "eval/<set>/pass@1": ...}`` from a record."""
    out: dict[str, float] = {}
    for section in ("rollout", "train", "time"):
        for key, value in record.get(section, {}).items():
            if _is_number(value):
                out[f"{section}/{key}"] = float(value)
    for name, metrics in record.get("eval", {}).items():
        for key, value in metrics.items():
            if _is_number(value):
                out[f"eval/{name}/{key}"] = float(value)
    return out


def rank0_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Rank 0's metrics (the backends reduce over DP ranks already) as plain floats."""
    return {k: float(v) for k, v in per_rank[0].items()} if per_rank else {}


def public_config(args: ParsedArgs) -> dict[str, Any]:
    """The flags as reported to W&B: every value but secrets (the engine API key, masked)."""
    config = dict(vars(args))
    if config.get("sglang_api_key"):
        config["sglang_api_key"] = redact(config["sglang_api_key"])
    return config


def closing_lines(args: ParsedArgs, records: list[dict[str, Any]], seconds: float) -> list[str]:
    """The end of a run: what ran, and where its checkpoints, metrics, picture and logs are."""
    lines = [f"done: {len(records)} rollout(s) in {seconds:.0f}s"]
    if args.save:
        try:
            latest = read_tracker(args.save)
        except Exception:  # a corrupt tracker is the next --load's error to report
            latest = None
        saved = f"latest iteration {latest}" if latest is not None else "none written"
        lines.append(f"  checkpoints: {args.save} ({saved}); resume with --load {args.save}")
    if args.metrics_jsonl:
        lines.append(f"  metrics: {args.metrics_jsonl}")
        name = os.path.basename(args.metrics_jsonl)
        other = "" if name == "metrics.jsonl" else f" --metrics {name}"
        lines.append(f"  picture: miles plot {run_dir(args)}{other} draws {run_dir(args)}/run.png")
    if args.tensorboard_dir:
        lines.append(f"  TensorBoard: tensorboard --logdir {args.tensorboard_dir}")
    if log_dir(args) and not args.load_debug_rollout_data:
        lines.append(f"  engine logs: {log_dir(args)}")
    return lines
