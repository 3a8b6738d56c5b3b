"""A GPU job's placement on a local Ray cluster whose node address is not loopback: each bundle's
node must be checked by the address Ray reports for it, not by the loopback address the job's
processes advertise on a local cluster (every ``miles train`` run on a GPU node failed at
placement on that: "Ray placed bundles [0] off their planned nodes"). Ray's GPUs are logical
here (``num_gpus=2`` on a CPU machine), so the GPU probe runs as on a GPU node."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.extended  # a Ray cluster of its own (~15 s)

PROGRAM = """
import json, os, sys
sys.path.insert(0, {tests!r})
from launch_testing import parse
from miles_sync.node_address import NODE_IP_ENV

from miles_launch.placement import Placement, plan_layout  # miles_launch keeps ray off uv run
import ray
os.environ[NODE_IP_ENV] = "127.0.0.1"  # what init_ray sets for a local cluster
ray.init(_node_ip_address={address!r}, num_cpus=3, num_gpus=2, include_dashboard=False,
         object_store_memory=128 * 1024**2, logging_level="ERROR",
         runtime_env={{"env_vars": {{NODE_IP_ENV: "127.0.0.1"}}}})
from pathlib import Path
args = parse(Path({tmp!r}), "--colocate", "--rollout-engine", "builtin", "--actor-num-gpus-per-node", "2")
placement = Placement(plan_layout(args, use_gpu=True), timeout_s=60)
print("RESULT " + json.dumps([[i.node_ip, list(i.gpu_ids)] for i in placement.infos]))
ray.shutdown()
"""


def _external_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: picks the outgoing interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_gpu_bundles_are_checked_by_the_node_ray_reports(tmp_path):
    address = _external_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    tests = str(Path(__file__).parent)
    code = PROGRAM.format(tests=tests, address=address, tmp=str(tmp_path))
    env = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    infos = json.loads(line.removeprefix("RESULT "))
    assert [ip for ip, _ in infos] == [address, address]
    assert sorted(g for _, gpus in infos for g in gpus) == [0, 1]  # one GPU per bundle
