"""``pytest --budget-report FILE``: what each test costs, for the CI budget (docs/ci.md).

Per test (setup, call and teardown together): wall seconds, CPU seconds of the test process and
of the processes it started and waited for (spawned ranks, ``miles train`` and the Ray
processes under it, engine servers), and how many processes it started (``subprocess`` and
``multiprocessing``) and how many of those were jobs on Ray (``miles train`` or the demo). CPU
seconds tell how much of a test's wall time the machine was busy, which a loaded machine's wall
times do not. Under xdist each worker writes ``FILE.<worker>``; ``scripts/ci_budget.py``
merges the parts and prints the tables.
"""

from __future__ import annotations

import json
import multiprocessing.process
import os
import resource
import subprocess
import time
from pathlib import Path

import pytest

RAY_JOB_MARKERS = ("miles_launch.train", "run_demo.py", "ray.init", "ray start")


def pytest_addoption(parser):
    parser.addoption(
        "--budget-report",
        metavar="FILE",
        default=None,
        help="write each test's wall and CPU seconds and process starts as JSON (docs/ci.md)",
    )


class _Counter:
    def __init__(self):
        self.processes = 0
        self.ray_jobs = 0


def _forkserver_cpu_seconds() -> float:
    """CPU seconds of this process's multiprocessing forkserver and of the ranks it forked and
    reaped (``tests/rank_context.py``): they are not this process's children."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    utime, stime, cutime, cstime = (int(f) for f in fields[11:15])
    return (utime + stime + cutime + cstime) / os.sysconf("SC_CLK_TCK")


def _cpu_seconds() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
    return own + _forkserver_cpu_seconds()


def _group(item) -> str:
    mark = item.get_closest_marker("xdist_group")
    return str(mark.args[0]) if mark is not None and mark.args else ""


class BudgetRecorder:
    def __init__(self, path: Path):
        self.path = path
        self.rows: dict[str, dict] = {}
        self.counter = _Counter()
        self._install_counters()

    def _install_counters(self) -> None:
        counter = self.counter
        popen_init = subprocess.Popen.__init__
        process_start = multiprocessing.process.BaseProcess.start

        def counted_popen(self, args, *rest, **kwargs):
            counter.processes += 1
            text = " ".join(map(str, args)) if isinstance(args, list | tuple) else str(args)
            if any(m in text for m in RAY_JOB_MARKERS):
                counter.ray_jobs += 1
            popen_init(self, args, *rest, **kwargs)

        def counted_start(self):
            counter.processes += 1
            process_start(self)

        subprocess.Popen.__init__ = counted_popen
        multiprocessing.process.BaseProcess.start = counted_start

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        wall, cpu = time.monotonic(), _cpu_seconds()
        processes, ray_jobs = self.counter.processes, self.counter.ray_jobs
        yield
        self.rows[item.nodeid] = {
            "wall_s": round(time.monotonic() - wall, 3),
            "cpu_s": round(_cpu_seconds() - cpu, 3),
            "processes": self.counter.processes - processes,
            "ray_jobs": self.counter.ray_jobs - ray_jobs,
            "group": _group(item),
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        }

    def pytest_sessionfinish(self, session):
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        out = self.path.with_name(f"{self.path.name}.{worker}") if worker else self.path
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.rows, indent=1))


def pytest_configure(config):
    path = config.getoption("--budget-report")
    if path:
        config.pluginmanager.register(BudgetRecorder(Path(path).resolve()), "ci-budget")
