"""Engine processes: log capture, exit detection, the death message with the log tail."""

from __future__ import annotations

import signal
import sys
import time

from miles_launch.engine_launch.process import ProcessHost, exit_description, read_tail


def _wait_exit(host: ProcessHost, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while (code := host.poll()) is None:
        assert time.monotonic() < deadline, "process did not exit"
        time.sleep(0.05)
    return code


def test_exit_status_and_log_tail(tmp_path):
    host = ProcessHost("engine-0", str(tmp_path))
    script = "import sys\nfor i in range(100): print('line', i)\nsys.exit(3)"
    pid, log_path = host.start([sys.executable, "-c", script], {"X": "1"})
    assert pid > 0 and log_path == str(tmp_path / "engine-0.log")
    assert _wait_exit(host) == 3
    tail = host.log_tail(5).splitlines()
    assert tail == [f"line {i}" for i in range(95, 100)]
    assert exit_description(3) == "exit status 3"


def test_stop_terminates_and_kill_is_described(tmp_path):
    host = ProcessHost("engine-1", str(tmp_path))
    host.start([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"], {})
    assert host.poll() is None
    assert host.stop(timeout=10) == -signal.SIGTERM
    assert exit_description(-signal.SIGKILL) == "killed by SIGKILL"
    assert read_tail(tmp_path / "engine-1.log").splitlines()[0].startswith("$ ")
    assert read_tail(tmp_path / "missing.log") == ""
