"""A restart whose engine's host actor is gone ends in one line naming the engine and its host
(``EngineSet.wait_for_host``, on a local Ray; extended: it starts Ray). The host actor runs a
real child process; ``ray.kill`` takes the actor away as Ray does when it gives up on a node
(the same ``RayActorError``; the node itself stays, so the line says the actor died)."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
from launch_testing import parse

pytestmark = [pytest.mark.slow, pytest.mark.extended]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_restart_whose_host_actor_is_gone_ends_in_one_line(tmp_path):
    import miles_launch  # noqa: F401  (before ray: it keeps ray off uv run)
    import ray
    from miles_launch.engine_launch.engine_set import EngineProcess, EngineSet
    from miles_launch.engine_launch.process import EngineDied, ProcessHost

    args = parse(tmp_path, "--engine-startup-timeout", "30")
    ray.init(num_cpus=1, include_dashboard=False, object_store_memory=80 * 1024**2)
    pid = None
    try:
        host = ray.remote(ProcessHost).options(num_cpus=0).remote("engine-1", str(tmp_path))
        ip, port = ray.get(host.endpoint.remote())
        child = [sys.executable, "-c", "import time; time.sleep(120)"]
        pid, log = ray.get(host.start.remote(child, {}))
        proc = EngineProcess("engine 1", f"http://{ip}:{port}", host, pid, log)
        engines = EngineSet(args, placement=None)
        engines.wait_for_host(proc)  # it answers: returns at once
        actor_pid = ray.get(host.__ray_call__.remote(lambda _: os.getpid()))
        ray.kill(host)
        # a state, not a delay: ray.kill returns before the actor is gone, and a poll sent in
        # between was answered (seen in CI); wait for the actor's worker process to exit
        deadline = time.monotonic() + 60
        while _alive(actor_pid):
            assert time.monotonic() < deadline, "the killed host actor's process did not exit"
            time.sleep(0.01)
        with pytest.raises(EngineDied) as failure:
            engines.wait_for_host(proc)
        line = str(failure.value)
        assert "\n" not in line, line
        assert line.startswith(
            f"engine 1 (http://{ip}:{port}) cannot be restarted on its placement: its host "
            f"actor on {ip} died ("
        ), line
    finally:
        ray.shutdown()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)  # the child the killed actor left behind
            except ProcessLookupError:
                pass
