"""``miles plot RUN_DIR``: the PNG from a metrics JSONL the Reporter wrote; one-line errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
from miles_launch.args import OutputArgs
from miles_launch.plot import PlotError, main, read_records
from miles_launch.reporting import Reporter


def _record(i: int, **extra) -> dict:
    return {
        "rollout_id": i,
        "rollout": {
            "reward_mean": 0.1 + 0.05 * i,
            "reward_min": 0.0,
            "reward_max": 0.3 + 0.05 * i,
            "response_len_mean": 8 - 0.3 * i,
        },
        "train": {"loss": -0.01, "ppo_kl": 0.001 * i, "entropy": 3.0 - 0.1 * i},
        "time": {"gen": 1.0 + 0.1 * i, "train": 0.8, "save": 0.0, "update": 0.1},
        **extra,
    }


def _run_dir(tmp_path, records):
    output = OutputArgs(metrics_jsonl=str(tmp_path / "metrics.jsonl"), progress=False)
    reporter = Reporter(output, None, len(records))
    for record in records:
        reporter.rollout(record)
    reporter.close()
    return tmp_path


def test_plot_writes_the_png_and_says_where(tmp_path, capsys):
    records = [_record(i) for i in range(8)]
    for i in (3, 7):
        records[i]["eval"] = {"held-out": {"reward_mean": 0.2 + 0.05 * i, "pass@1": 0.5}}
        records[i]["time"]["eval"] = 0.5
    run_dir = _run_dir(tmp_path, records)
    capsys.readouterr()
    main([str(run_dir)])
    assert capsys.readouterr().out == f"miles plot: wrote {run_dir / 'run.png'}\n"
    png = (run_dir / "run.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (1400, 1300)


def test_records_are_read_by_rollout_id_the_last_winning(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"rollout_id": 1, "v": "a"}\n{"eval_after": 0}\n\n{"rollout_id": 0}\n')
    path.write_text(path.read_text() + '{"rollout_id": 1, "v": "b"}\n')  # a resumed run
    assert read_records(path) == [{"rollout_id": 0}, {"rollout_id": 1, "v": "b"}]
    path.write_text('{"eval_after": 0}\n')
    with pytest.raises(PlotError, match="metrics.jsonl: no rollout records"):
        read_records(path)
    path.write_text("{oops\n")
    with pytest.raises(PlotError, match=r"metrics.jsonl:1: invalid JSON"):
        read_records(path)


def _cli(*argv):
    return subprocess.run(
        [sys.executable, "-m", "miles_launch.cli", "plot", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["{tmp}/nope"], "error: miles plot {tmp}/nope: no such directory"),
        (["{tmp}"], "error: miles plot {tmp}: no metrics file {tmp}/metrics.jsonl (--metrics)"),
        ([], "error: miles plot: the following arguments are required: RUN_DIR"),
    ],
)
def test_bad_arguments_are_one_line_exit_2(tmp_path, argv, message):
    result = _cli(*(a.format(tmp=tmp_path) for a in argv))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [message.format(tmp=tmp_path)]


def test_each_panel_draws_the_records_metrics():
    import matplotlib.pyplot as plt
    from miles_launch.plot import run_figure

    records = [_record(i) for i in range(4)]
    del records[1]["train"]["ppo_kl"]
    records[2]["eval"] = {"held-out": {"reward_mean": 0.9}}
    records[2]["time"]["eval"] = 0.5
    for r in records:
        del r["train"]["entropy"]
    records[3]["train"] |= {"grad_norm": 0.7, "pg_clipfrac": 0.1, "critic/value_loss": 0.4}
    records[0]["train"] |= {"grad_norm": 0.5, "critic/grad_norm": 2.0, "tis": 1.1,
                            "train_rollout_logprob_abs_diff": 0.02,
                            "train_rollout_logprob_abs_diff_max": 0.9,
                            "train_rollout_logprob_abs_diff_sample_max": 0.3}  # fmt: skip
    for r in records:
        r["rollout"] |= {"pass@1": 0.25, "pass@2": 0.4, "pass@4": 0.5}
    records[2]["eval"]["held-out"] |= {"pass@1": 0.75, "pass@8": 1.0}
    fig = run_figure(records, "t")
    try:
        reward, kl, entropy, length, times = fig.axes[0::2]
        passes, grad, clip, value, tis = fig.axes[1::2]

        def lines(ax):
            return {
                line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
                for line in ax.get_lines()
            }

        assert list(lines(reward)) == ["rollout reward_mean", "eval held-out reward_mean"]
        xs, ys = lines(reward)["rollout reward_mean"]
        assert xs == [0, 1, 2, 3] and ys == pytest.approx([0.1, 0.15, 0.2, 0.25])
        assert lines(reward)["eval held-out reward_mean"] == ([2], [0.9])
        (xs, ys), *others = lines(kl).values()
        assert others == [] and xs == [0, 2, 3] and ys == pytest.approx([0.0, 0.002, 0.003])
        assert lines(entropy) == {}
        assert [t.get_text() for t in entropy.texts] == ["not recorded (train/entropy)"]
        assert lines(length)["response_len_mean"][1] == pytest.approx([8, 7.7, 7.4, 7.1])
        assert list(lines(times)) == ["gen", "train", "save", "update", "eval"]
        assert lines(times)["eval"] == ([2], [0.5])
        assert list(lines(passes)) == [
            "rollout pass@1", "rollout pass@4", "eval held-out pass@1", "eval held-out pass@8",
        ]  # fmt: skip
        assert lines(passes)["rollout pass@4"] == ([0, 1, 2, 3], [0.5] * 4)
        assert lines(passes)["eval held-out pass@8"] == ([2], [1.0])
        assert lines(grad) == {"actor": ([0, 3], [0.5, 0.7]), "critic": ([0], [2.0])}
        assert lines(clip) == {"pg_clipfrac": ([3], [0.1])}
        assert lines(value) == {"value_loss": ([3], [0.4])}
        assert lines(tis) == {
            "mean weight": ([0], [1.1]),
            "|log-prob diff| mean": ([0], [0.02]),
            "|log-prob diff| max": ([0], [0.9]),
            "worst sample's |diff|": ([0], [0.3]),
        }
    finally:
        plt.close(fig)
