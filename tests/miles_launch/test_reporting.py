"""Per-rollout summary line, TensorBoard scalars read back, JSONL records."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from miles_launch.args import OutputArgs
from miles_launch.reporting import Reporter, flatten_scalars, summary_line

RECORD = {
    "rollout_id": 2,
    "rollout": {"reward_mean": 0.4123, "response_len_mean": 7.94, "generated_with_versions": [3]},
    "train": {"loss": -0.01234, "ppo_kl": 0.00011, "grad_norm": 0.5},
    "time": {"gen": 1.2, "train": 0.8, "save": 0.0, "update": 0.1},
    "weight_version": 4,
}


def test_summary_line():
    assert summary_line(RECORD, 12) == (
        "rollout 3/12 | reward 0.412 | resp_len 7.9 | loss -0.0123 | kl 0.0001 | version 4 | "
        "gen 1.20s train 0.80s save 0.00s update 0.10s"
    )
    mismatched = RECORD | {"train": RECORD["train"] | {"train_rollout_logprob_abs_diff": 0.00213}}
    assert " | kl 0.0001 | mismatch 0.0021 | version 4 | " in summary_line(mismatched, 12)


def test_scalars_reach_tensorboard_and_jsonl(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    output = OutputArgs(metrics_jsonl=str(tmp_path / "m.jsonl"), progress=False)
    reporter = Reporter(output, str(tmp_path / "tb"), num_rollout=12)
    reporter.rollout(RECORD)
    evaluated = {
        **RECORD,
        "rollout_id": 3,
        "rollout": {**RECORD["rollout"], "reward_mean": 0.5},
        "time": {**RECORD["time"], "eval": 2.5},
        "eval": {"gsm8k": {"reward_mean": 0.25, "pass@1": 0.25, "pass@2": 0.5}, "aime": {}},
    }
    reporter.rollout(evaluated)
    reporter.close()
    out = capsys.readouterr().out
    assert "rollout 4/12 | reward 0.500" in out
    assert (
        "eval after rollout 4 | gsm8k | reward_mean 0.2500 | pass@1 0.2500 | pass@2 0.5000\n" in out
    )

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    rewards = [(e.step, e.value) for e in events.Scalars("rollout/reward_mean")]
    assert [step for step, _ in rewards] == [2, 3]
    assert [value for _, value in rewards] == pytest.approx([0.4123, 0.5], rel=1e-6)
    assert [(e.step, e.value) for e in events.Scalars("eval/gsm8k/pass@2")] == [(3, 0.5)]
    assert [(e.step, e.value) for e in events.Scalars("time/eval")] == [(3, 2.5)]
    assert set(flatten_scalars(RECORD)) <= set(events.Tags()["scalars"])

    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert lines[0]["rollout"]["reward_mean"] == 0.4123
    assert len(lines) == 2  # one record per rollout, the eval inside it
    assert lines[1]["eval"] == evaluated["eval"] and lines[1]["time"]["eval"] == 2.5


@pytest.mark.parametrize(
    "tty, flag, shown", [(True, True, True), (False, True, False), (True, False, False)]
)
def test_progress_bars_only_on_a_terminal(monkeypatch, tty, flag, shown):
    """A log file (stderr not a terminal) gets no bar: its carriage returns and ANSI codes would
    litter it (--no-progress turns bars off on a terminal too)."""
    import sys

    from miles_launch.reporting import progress_on

    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty, raising=False)
    output = OutputArgs(progress=flag)
    assert progress_on(output) is shown
    assert Reporter(output, None, num_rollout=1).show_progress is shown


def test_closing_lines_say_where_everything_is(tmp_path):
    from miles_core.checkpoint_layout import write_tracker
    from miles_launch.reporting import closing_lines

    save = tmp_path / "ckpt"
    save.mkdir()
    write_tracker(save, 12)
    args = SimpleNamespace(
        save=str(save),
        metrics_jsonl=str(tmp_path / "run" / "metrics.jsonl"),
        tensorboard_dir=str(tmp_path / "tb"),
        load_debug_rollout_data=None,
    )
    lines = closing_lines(args, [RECORD] * 3, 61.2)
    run = tmp_path / "run"
    assert lines == [
        "done: 3 rollout(s) in 61s",
        f"  checkpoints: {save} (latest iteration 12); resume with --load {save}",
        f"  metrics: {run / 'metrics.jsonl'}",
        f"  picture: miles plot {run} draws {run / 'run.png'}",
        f"  TensorBoard: tensorboard --logdir {tmp_path / 'tb'}",
        f"  engine logs: {run / 'logs'}",
    ]
