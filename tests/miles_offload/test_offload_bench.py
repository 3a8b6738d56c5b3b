"""``miles-offload-bench`` on the CPU (the "device" is host memory): the same code as on a GPU."""

from __future__ import annotations

import json

import pytest
from miles_offload.bench import main


def test_bench_runs_and_accounts_for_its_time(tmp_path, capsys):
    out = tmp_path / "bench.json"
    disk = tmp_path / "disk"
    main(
        ["--size-gb", "0.02", "--cycles", "2", "--chunk-mb", "4", "--device", "cpu"]
        + ["--disk-dir", str(disk), "--json", str(out)]
    )
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["rows"]}
    for name in (
        "ceiling: pinned D2H",
        "ours: sleep (cycle >= 2)",
        "ours: wake, copy phase only",
        "ours: sleep to disk",
        "naive: .cpu() per tensor",
        "diagnostic: H2D per tensor, allocated",
        "diagnostic: H2D into fresh memory",
    ):
        assert rows[name]["seconds"] > 0, name
    sleep, wake = rows["ours: sleep (cycle >= 2)"], rows["ours: wake (cycle >= 2)"]
    assert sleep["ratio"] == pytest.approx(
        rows["ceiling: pinned D2H"]["gbps"] and sleep["gbps"] / rows["ceiling: pinned D2H"]["gbps"]
    )
    per_tensor = rows["diagnostic: H2D per tensor, allocated"]
    assert per_tensor["gigabytes"] == pytest.approx(result["state_gb"])
    assert per_tensor["ceiling"] == "ceiling: pinned H2D"
    # the phases are parts of the call: they add up to no more than its wall time
    phases = result["phases_seconds"]
    assert set(phases["sleep"]) == {"plan", "copy", "rebind", "free"}
    assert set(phases["wake"]) == {"copy", "rebind"}
    assert sum(phases["sleep"].values()) <= sleep["seconds"] * (1 + 1e-6)
    assert sum(phases["wake"].values()) <= wake["seconds"] * (1 + 1e-6)
    assert not list(disk.glob("*"))  # the disk target's files are removed
    assert "sleep phases (cycle >= 2): " in capsys.readouterr().out


def test_bench_refuses_a_single_cycle():
    with pytest.raises(SystemExit) as exit_info:
        main(["--cycles", "1"])
    assert exit_info.value.code == 2
