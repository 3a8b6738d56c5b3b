"""An engine's host cut off the network mid-rollout (``extended``).

The job of ``test_two_engines_on_two_hosts`` (trainer on host a, built-in engines on hosts b
and c, 2 rollouts, ``--update-weight-verify``), with ``--engine-health-timeout 3``. Once engine
1 (host c) reports requests running, host c's port on the switch goes down: its engine, its
Ray node and their connections stay up, and every packet to or from them is dropped. The
launcher must see the engine hang through ``/health``, fail the requests it holds and send
their groups again, whole, to engine 0; restart engine 1 on its placement once host c
answers again (the test restores the link after the launcher gave up on the engine, a blip
shorter than Ray's own node-failure detection); publish the current weights to it (read back
bit for bit); and generate the second rollout on both engines. Every sample is accounted for
once: the saved rollouts hold each (group, sample) exactly once, and the metrics count the
re-issued requests in whole groups.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
import torch
from miles_core import backends
from test_multihost_jobs import fsdp_saved_state, run_job
from train_runs import assert_publishes_verified

pytestmark = [
    pytest.mark.slow,
    pytest.mark.extended,
    pytest.mark.timeout(900),
    pytest.mark.skipif("fsdp" not in backends.available(), reason="FSDP backend not installed"),
]

#: Runs on host a: polls an engine's ``/get_server_info`` until it reports running requests,
#: then at once runs the cut command (the last arguments) and prints their number (exit 0); exit
#: 1 when the timeout passes first.
CUT_WHEN_BUSY = """
import subprocess, sys, time, httpx
url, key, timeout, cut = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4:]
headers = {"Authorization": "Bearer " + key}
deadline = time.monotonic() + timeout
with httpx.Client(headers=headers, timeout=5) as client:
    while time.monotonic() < deadline:
        try:
            running = client.get(url + "/get_server_info").json().get("num_requests", 0)
        except (httpx.HTTPError, ValueError):
            running = 0
        if running > 0:
            subprocess.run(cut, check=True)
            print(running)
            sys.exit(0)
        time.sleep(0.01)
sys.exit(1)
"""
#: "engine K: URL (pid N, ...": what the launcher logs as it starts (and restarts) an engine.
ENGINE = re.compile(r"engine (\d+): (http://([\d.]+):\d+) \(pid (\d+),")


def hung_line(k: str) -> re.Pattern:
    """The launcher's line for engine ``k`` found hung (the host it served on: group 1)."""
    return re.compile(
        rf"engine {k} \(http://([\d.]+):\d+, pid \d+\) did not answer /health for \d+s "
        r"during generation \(hung\): restarting it"
    )


def engine_key(pid: int) -> str:
    """The API key in the environment of the engine process ``pid`` (the job generated it)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    return dict(item.split("=", 1) for item in environ if "=" in item)["MILES_ENGINE_API_KEY"]


class CutMidRollout:
    """The ``during`` of the job: once the engine on ``host`` runs requests, cut its host; once the
    launcher declared it hung, restore the link (a state each, never a delay)."""

    def __init__(self, cluster, host):
        self.cluster, self.host = cluster, host
        self.engine = ""  # the index of the engine on ``host``
        self.in_flight = 0  # requests it ran just before the cut
        self.cut_at = self.restored_at = None  # output offsets
        self.restored_after_s = 0.0

    def __call__(self, text: str) -> bool:
        if self.cut_at is None:
            engines = {ip: (k, url, int(pid)) for k, url, ip, pid in ENGINE.findall(text)}
            if self.host.address not in engines:
                return False
            self.engine, url, pid = engines[self.host.address]
            argv = [sys.executable, "-c", CUT_WHEN_BUSY, url, engine_key(pid), "120"]
            poll = self.cluster.run(
                self.cluster.head, argv + self.cluster.cut_command(self.host), timeout=180
            )
            assert poll.returncode == 0, f"engine {self.engine} ran no request: {poll.stderr}"
            self.in_flight = int(poll.stdout.strip())
            self.cut_at, self._cut_time = len(text), time.monotonic()
            return False
        if not hung_line(self.engine).search(text, self.cut_at):
            assert time.monotonic() - self._cut_time < 120, f"never hung: {text[-3000:]}"
            return False
        self.cluster.restore(self.host)
        self.restored_at, self.restored_after_s = len(text), time.monotonic() - self._cut_time
        return True


def test_an_engine_host_cut_off_mid_rollout(cluster, material, tmp_path):
    host_c = cluster.hosts[2]
    dump = tmp_path / "rollout_{rollout_id}.pt"
    cut = CutMidRollout(cluster, host_c)
    start = time.monotonic()
    try:
        text, records, _ = run_job(
            cluster,
            material,
            tmp_path,
            "--num-rollout", "2", "--rollout-num-gpus", "2",
            "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
            "--rollout-max-response-len", "200",
            "--update-weight-transfer-mode", "broadcast",
            "--engine-health-timeout", "3", "--engine-restart-backoff", "0",
            "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
            "--save-debug-rollout-data", str(dump),
            during=cut,
        )  # fmt: skip
    finally:
        cluster.restore(host_c)  # never leave the session's cluster cut
    print(f"host cut job: {time.monotonic() - start:.0f} s, link down {cut.restored_after_s:.0f} s")
    assert cut.in_flight > 0 and cut.restored_at is not None
    k = cut.engine
    hung = hung_line(k).search(text, cut.cut_at)
    assert hung and hung.group(1) == host_c.address, text[cut.cut_at :][-4000:]
    # restarted on its host (the same placement), only once the host answered again
    restarted = re.findall(rf"engine {k} restarted at http://([\d.]+):\d+", text)
    assert restarted == [host_c.address], restarted
    assert text.index(f"engine {k} restarted at") > cut.restored_at
    assert [r["rollout_id"] for r in records] == [0, 1]
    first, second = (r["rollout"] for r in records)
    assert first["engine_restarts"] == 1 and second["engine_restarts"] == 0, (first, second)
    # the groups engine 1 held were sent again, whole (groups of --n-samples-per-prompt 4)
    assert first["requests_reissued"] > 0 and first["requests_reissued"] % 4 == 0, first
    assert second["requests_reissued"] == 0
    for r in records:
        assert r["rollout"]["num_samples"] == 32
        assert len(r["rollout"]["generated_with_versions"]) == 1
        data = torch.load(str(dump).format(rollout_id=r["rollout_id"]), weights_only=True)
        groups = [s["group_index"] for s in data["samples"]]
        assert sorted(groups) == sorted(list(range(8)) * 4), groups  # every sample once
    # every publish, the ones after the restart included, read back from both engines
    final = assert_publishes_verified(text, [1, 2, 3], engines=2)
    assert final == fsdp_saved_state(tmp_path / "ckpt", 2)
