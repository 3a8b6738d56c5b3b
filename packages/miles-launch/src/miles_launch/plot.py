"""``miles plot RUN_DIR``: a run's curves per rollout as one PNG, from its metrics JSONL.

Reads ``RUN_DIR/metrics.jsonl`` (``--metrics-jsonl`` of the run; ``--metrics FILE`` for another
name) and writes ``RUN_DIR/run.png`` (``--output PNG``), ten panels over the rollout id, in two
columns. The run:

* reward: mean, with the min..max band, and each eval set's ``reward_mean`` (the evaluation
  before training at rollout -1);
* KL: the train metrics ``ppo_kl`` and ``kl_loss`` (those present);
* entropy: the train metric ``entropy``;
* response length: ``response_len_mean``;
* phase times: seconds of each phase (``gen``, ``train``, ``save``, ``update``, ``eval``, ...).

The optimisation:

* pass@k: the training rollouts' and each eval set's pass@1 and pass@k at their largest k;
* gradient norm: ``grad_norm`` of the actor and (``--use-critic``) the critic;
* clip fraction: ``pg_clipfrac``, ``pg_dual_clipfrac`` and the critic's ``value_clipfrac``;
* value loss: the critic's ``value_loss``;
* train/rollout mismatch: ``train_rollout_logprob_abs_diff``, its token maximum
  ``train_rollout_logprob_abs_diff_max``, the worst sample's
  ``train_rollout_logprob_abs_diff_sample_max`` and ``train_rollout_k3_kl`` (whenever the
  engine returned log-probs; :mod:`miles_core.mismatch`), and with ``--use-tis`` the mean
  weight ``tis`` and ``tis_clipfrac``.

A panel whose metric the run did not record says so. Bad arguments (no such directory, no
metrics file, no rollout records) are one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from miles_core.mismatch import ABS_DIFF, ABS_DIFF_MAX, ABS_DIFF_SAMPLE_MAX, K3_KL

PHASES = ("gen", "train", "save", "update", "eval")  # drawn in this order, then any others


class PlotError(ValueError):
    """A bad ``miles plot`` argument or metrics file (one line)."""


def read_records(path: Path) -> list[dict[str, Any]]:
    """The rollout records of a metrics JSONL, by rollout id (a resumed run's later record of
    a rollout wins)."""
    by_id: dict[int, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise PlotError(f"{path}:{line_no}: invalid JSON ({error.msg})") from None
            if isinstance(record, dict) and "rollout_id" in record:
                by_id[int(record["rollout_id"])] = record
    if not by_id:
        raise PlotError(f"{path}: no rollout records")
    return [by_id[i] for i in sorted(by_id)]


def _series(records: list[dict], section: str, key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        value = r.get(section, {}).get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            xs.append(r["rollout_id"])
            ys.append(float(value))
    return xs, ys


def _plot_lines(ax: Any, records: list[dict], lines: list[tuple[str, str, str]]) -> None:
    drawn = False
    for section, key, label in lines:
        xs, ys = _series(records, section, key)
        if xs:
            # a metric of some rollouts only (eval time): points, no line across the gaps
            style = "-" if len(xs) >= sum(r["rollout_id"] >= 0 for r in records) else "none"
            ax.plot(xs, ys, marker="o", markersize=3, linestyle=style, label=label)
            drawn = True
    if drawn:
        ax.legend(fontsize=8)
    else:
        names = ", ".join(f"{s}/{k}" for s, k, _ in lines)
        ax.text(0.5, 0.5, f"not recorded ({names})", ha="center", va="center",
                transform=ax.transAxes, fontsize=9, color="gray")  # fmt: skip


def _pass_keys(metrics: dict[str, Any]) -> list[str]:
    """``pass@1`` and the pass@k of the largest k among ``metrics``' keys (those present)."""
    ks = sorted(int(k[5:]) for k in metrics if k.startswith("pass@") and k[5:].isdigit())
    return [f"pass@{k}" for k in dict.fromkeys([ks[0], ks[-1]])] if ks else []


def _plot_pass_at_k(ax: Any, records: list[dict]) -> None:
    keys = {k for r in records for k in _pass_keys(r.get("rollout", {}))}
    lines = [("rollout", k, f"rollout {k}") for k in sorted(keys, key=lambda k: int(k[5:]))]
    if lines:
        _plot_lines(ax, records, lines)
    sets = sorted({name for r in records for name in r.get("eval", {})})
    for name in sets:
        for key in sorted(
            {k for r in records for k in _pass_keys(r.get("eval", {}).get(name, {}))},
            key=lambda k: int(k[5:]),
        ):
            pts = [(r["rollout_id"], r["eval"][name][key]) for r in records
                   if key in r.get("eval", {}).get(name, {})]  # fmt: skip
            ax.plot(*zip(*pts), marker="s", linestyle="--", label=f"eval {name} {key}")
    if ax.get_lines():
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "not recorded (rollout/pass@k, eval/<set>/pass@k)", ha="center",
                va="center", transform=ax.transAxes, fontsize=9, color="gray")  # fmt: skip


def write_run_plot(records: list[dict[str, Any]], path: Path, title: str) -> None:
    """The ten panels (module docstring) of ``records`` as a PNG at ``path``."""
    import matplotlib.pyplot as plt  # after run_figure's matplotlib.use("Agg") is in reach

    fig = run_figure(records, title)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_figure(records: list[dict[str, Any]], title: str) -> Any:
    """The matplotlib figure of :func:`write_run_plot` (``fig.axes`` row by row: reward,
    pass@k, KL, gradient norm, entropy, clip fraction, response length, value loss, phase
    times, train/rollout mismatch)."""
    # the Agg backend is chosen here, when a plot is drawn, not when the module is imported
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use
    from matplotlib.ticker import MaxNLocator  # with pyplot

    fig, axes = plt.subplots(5, 2, figsize=(14, 13), sharex=True)
    reward, kl, entropy, length, times = axes[:, 0]
    passes, grad, clip, value, tis = axes[:, 1]

    xs, mean = _series(records, "rollout", "reward_mean")
    _, low = _series(records, "rollout", "reward_min")
    _, high = _series(records, "rollout", "reward_max")
    reward.plot(xs, mean, marker="o", markersize=3, label="rollout reward_mean")
    if len(low) == len(high) == len(xs):
        reward.fill_between(xs, low, high, alpha=0.2, label="rollout min..max")
    sets = sorted({name for r in records for name in r.get("eval", {})})
    for name in sets:
        ex = [r["rollout_id"] for r in records if "reward_mean" in r.get("eval", {}).get(name, {})]
        ey = [r["eval"][name]["reward_mean"] for r in records if r["rollout_id"] in ex]
        reward.plot(ex, ey, marker="s", linestyle="--", label=f"eval {name} reward_mean")
    reward.set_ylabel("reward")
    reward.legend(fontsize=8)

    _plot_lines(kl, records, [("train", "ppo_kl", "ppo_kl"), ("train", "kl_loss", "kl_loss")])
    kl.set_ylabel("KL")
    _plot_lines(entropy, records, [("train", "entropy", "entropy")])
    entropy.set_ylabel("entropy")
    _plot_lines(length, records, [("rollout", "response_len_mean", "response_len_mean")])
    length.set_ylabel("response length (tokens)")
    seen = {k for r in records for k in r.get("time", {})}
    phases = [p for p in PHASES if p in seen] + sorted(seen - set(PHASES))
    _plot_lines(times, records, [("time", phase, phase) for phase in phases])
    times.set_ylabel("phase time (s)")
    times.set_xlabel("rollout")
    times.xaxis.set_major_locator(MaxNLocator(integer=True))  # rollout ids, not 0.5 steps

    _plot_pass_at_k(passes, records)
    passes.set_ylabel("pass@k")
    _plot_lines(grad, records, [("train", "grad_norm", "actor"),
                                ("train", "critic/grad_norm", "critic")])  # fmt: skip
    grad.set_ylabel("gradient norm")
    _plot_lines(clip, records, [("train", "pg_clipfrac", "pg_clipfrac"),
                                ("train", "pg_dual_clipfrac", "pg_dual_clipfrac"),
                                ("train", "critic/value_clipfrac", "value_clipfrac")])  # fmt: skip
    clip.set_ylabel("clip fraction")
    _plot_lines(value, records, [("train", "critic/value_loss", "value_loss")])
    value.set_ylabel("value loss")
    _plot_lines(tis, records, [("train", ABS_DIFF, "|log-prob diff| mean"),
                               ("train", ABS_DIFF_MAX, "|log-prob diff| max"),
                               ("train", ABS_DIFF_SAMPLE_MAX, "worst sample's |diff|"),
                               ("train", K3_KL, "K3 KL"),
                               ("train", "tis", "mean weight"),
                               ("train", "tis_clipfrac", "tis_clipfrac")])  # fmt: skip
    tis.set_ylabel("train/rollout mismatch")
    tis.set_xlabel("rollout")
    tis.xaxis.set_major_locator(MaxNLocator(integer=True))

    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        raise PlotError(f"miles plot: {message}")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(prog="miles plot", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run's output directory")
    parser.add_argument(
        "--metrics", default="metrics.jsonl", help="metrics JSONL (relative: in RUN_DIR)"
    )
    parser.add_argument("--output", default=None, help="PNG to write (default RUN_DIR/run.png)")
    ns = parser.parse_args(argv)
    run_dir = Path(ns.run_dir)
    if not run_dir.is_dir():
        raise PlotError(f"miles plot {run_dir}: no such directory")
    ns.metrics = run_dir / ns.metrics
    if not ns.metrics.is_file():
        raise PlotError(f"miles plot {run_dir}: no metrics file {ns.metrics} (--metrics)")
    ns.output = Path(ns.output) if ns.output else run_dir / "run.png"
    return ns


def main(argv: list[str]) -> None:
    try:
        ns = parse(argv)
        records = read_records(ns.metrics)
    except PlotError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    rollouts = sum(r["rollout_id"] >= 0 for r in records)  # rollout -1: the eval before training
    write_run_plot(records, ns.output, title=f"{ns.run_dir}: {rollouts} rollouts")
    print(f"miles plot: wrote {ns.output}")
