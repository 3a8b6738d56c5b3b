#!/usr/bin/env python3
"""The CI budget's tables from ``pytest --budget-report FILE`` runs (tests/ci_budget.py).

    uv run pytest --budget-report /tmp/budget/default.json
    uv run pytest -m extended --budget-report /tmp/budget/extended.json
    python3 scripts/ci_budget.py /tmp/budget/default.json /tmp/budget/extended.json

For each report (its xdist parts ``FILE.gw0`` ... merged): the tests, wall and CPU seconds and
process starts by package directory and by xdist group, and the slowest tests. Wall seconds
add up the tests' own times (with several workers the stage's wall time is less); CPU seconds
say how busy the machine was meanwhile. ``--json OUT`` writes the merged rows and totals.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

FIELDS = ("wall_s", "cpu_s", "processes", "ray_jobs")


def load(path: Path) -> dict[str, dict]:
    """The rows of ``path`` and of its per-worker parts."""
    parts = [path] if path.exists() else []
    parts += sorted(path.parent.glob(f"{path.name}.gw*"))
    if not parts:
        raise FileNotFoundError(f"{path}: no report (nor {path.name}.gw* parts)")
    rows: dict[str, dict] = {}
    for part in parts:
        rows.update(json.loads(part.read_text()))
    return rows


def totals(rows: dict[str, dict], key) -> dict[str, dict]:
    out: dict[str, dict] = defaultdict(lambda: dict.fromkeys(("tests", *FIELDS), 0))
    for nodeid, row in rows.items():
        t = out[key(nodeid, row)]
        t["tests"] += 1
        for field in FIELDS:
            t[field] += row[field]
    return dict(out)


def directory(nodeid: str, row: dict) -> str:
    path = nodeid.split("::")[0]
    return path.rsplit("/", 1)[0] if "/" in path else path


def table(title: str, sums: dict[str, dict]) -> list[str]:
    lines = [f"{title:<44} {'tests':>6} {'wall s':>8} {'cpu s':>8} {'procs':>6} {'ray':>4}"]
    for name, t in sorted(sums.items(), key=lambda kv: -kv[1]["wall_s"]):
        lines.append(
            f"{name:<44} {t['tests']:>6} {t['wall_s']:>8.0f} {t['cpu_s']:>8.0f} "
            f"{t['processes']:>6} {t['ray_jobs']:>4}"
        )
    return lines


def report(name: str, rows: dict[str, dict], top: int) -> tuple[list[str], dict]:
    everything = totals(rows, lambda n, r: "all")["all"] if rows else {}
    lines = [f"== {name}: {len(rows)} tests", ""]
    lines += table("by directory", totals(rows, directory)) + [""]
    groups = totals(rows, lambda n, r: "(no group)" if not r["group"] else "(grouped)")
    lines += table("by xdist grouping", groups)
    lines += ["", f"{'slowest tests':<80} {'wall s':>7} {'cpu s':>7} {'procs':>5}"]
    for nodeid, row in sorted(rows.items(), key=lambda kv: -kv[1]["wall_s"])[:top]:
        lines.append(
            f"{nodeid[:80]:<80} {row['wall_s']:>7.1f} {row['cpu_s']:>7.1f} {row['processes']:>5}"
        )
    return lines, everything


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    summary = {}
    for path in args.reports:
        try:
            rows = load(path)
        except (OSError, ValueError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        lines, everything = report(path.name, rows, args.top)
        print("\n".join(lines) + "\n")
        summary[path.name] = {"totals": everything, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
