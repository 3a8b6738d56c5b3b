"""``miles train`` across hosts: trainer ranks on host a, built-in engines on hosts b (and c).

The hosts are network namespaces of one Ray cluster (``netns_cluster``); the driver runs on
host a. Each job checks what crosses a host: the engines serve on their host's address, the
weight-update group's master is the publishing rank's host address (never loopback), the job
runs with an engine API key, and a request from another host without the key is refused. Every
job runs with ``--update-weight-verify``: after each publish, the first included, rank 0 reads
every tensor back from each engine and the job fails unless they are the trainer's, bit for bit
(``assert_publishes_verified`` shows that every publish was checked).

The default suite runs one job (FSDP, ``broadcast``, 1 rollout); the rest of the matrix (FSDP
with two engines on two hosts in each group mode, and Megatron TP=2) is ``extended``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from miles_core import backends
from miles_launch.demo import demo_flags
from miles_sync.readback import tensors_digest
from netns_cluster import NamespaceCluster
from train_runs import assert_publishes_verified, dcp_tensors

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.skipif("fsdp" not in backends.available(), reason="FSDP backend not installed"),
]

ROOT = Path(__file__).resolve().parents[2]
ENGINE_LINE = re.compile(r"engine (\d+): (http://([\d.]+):\d+) \(pid \d+, log (\S+)\)")
MASTER_LINE = re.compile(r"joined weight-update group \S+ at master ([\d.]+):\d+")
SMALL = [
    "--rollout-batch-size", "2",
    "--n-samples-per-prompt", "2",
    "--rollout-max-response-len", "4",
    "--num-steps-per-rollout", "1",
    "--actor-num-gpus-per-node", "2",
    "--num-gpus-per-node", "2",
    "--engine-startup-timeout", "900",
    "--no-progress",
    "--update-weight-verify",
]  # fmt: skip
#: A request without the key, from another host: the status it gets (or "unreachable").
PROBE = """
import sys, urllib.request, urllib.error
try:
    urllib.request.urlopen(sys.argv[1] + "/get_model_info", timeout=10)
    print(200)
except urllib.error.HTTPError as e:
    print(e.code)
except OSError:
    print("unreachable")
"""


def run_job(
    cluster: NamespaceCluster,
    material,
    out: Path,
    *flags: str,
    probe_from=None,
    base=demo_flags,
    during: Callable[[str], bool] | None = None,
) -> tuple[str, list[dict], list[str]]:
    """``miles train`` on host a against the cluster (``base(hf, prompts, metrics)``: the
    job's flags before :data:`SMALL` and ``flags``); returns (output, metrics records, the
    keyless probe's answers from ``probe_from``, taken while the engines run). ``during``:
    called with the output so far every tick while the job runs, until it returns True."""
    hf, prompts = material
    metrics = out / "metrics.jsonl"
    log = out / "driver.log"
    cmd = [
        sys.executable, "-m", "miles_launch.train",
        *base(hf, prompts, metrics), *SMALL,
        "--ray-address", cluster.ray_address, *flags,
    ]  # fmt: skip
    answers: list[str] = []
    with open(log, "wb") as sink:
        # every line as the ranks print it: Ray's deduplication drops lines that differ only
        # in their digits (the second "weight version N verified" within a few seconds)
        env = {"RAY_DEDUP_LOGS": "0"}
        driver = cluster.popen(cluster.head, cmd, stdout=sink, stderr=sink, cwd=ROOT, env_extra=env)
        deadline = time.monotonic() + 1500
        try:
            while driver.poll() is None and time.monotonic() < deadline:
                engines = ENGINE_LINE.findall(log.read_text(errors="replace"))
                if probe_from is not None and engines and not answers:
                    answer = cluster.run(
                        probe_from, [sys.executable, "-c", PROBE, engines[0][1]], timeout=60
                    ).stdout.strip()
                    if answer != "unreachable":  # not serving yet: ask again
                        answers.append(answer)
                if during is not None and during(log.read_text(errors="replace")):
                    during = None
                time.sleep(2)
        finally:
            if driver.poll() is None:
                driver.kill()
            driver.wait(60)
    text = log.read_text(errors="replace")
    assert driver.returncode == 0, text[-6000:]
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if "rollout_id" in r]
    return text, records, answers


def fsdp_saved_state(save: Path, rollouts: int) -> str:
    """The state digest (as ``--update-weight-verify`` logs it) of the model the FSDP trainer
    saved after its last rollout: the engines' weights, read back after the last publish, must
    be these."""
    saved = dcp_tensors(save / f"iter_{rollouts:07d}" / "model")  # names under "model."
    return tensors_digest((name.removeprefix("model."), t) for name, t in saved.items())


def megatron_saved_state(save: Path, hf: Path, out: Path) -> str:
    """The same for the megatron trainer's torch_dist checkpoint, converted to HF tensors by
    ``miles_megatron.convert`` (offline, one process: not the publish path's gather)."""
    from megatron_cli import megatron_cli_env
    from safetensors.torch import load_file

    cmd = [
        sys.executable, "-m", "miles_megatron.convert", "torch-dist-to-hf",
        "--load", str(save), "--hf-checkpoint", str(hf), "--save", str(out),
    ]  # fmt: skip
    run = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=megatron_cli_env()
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return tensors_digest(load_file(out / "model.safetensors").items())


def check_addresses(cluster: NamespaceCluster, text: str, engine_hosts: list[str]) -> None:
    """Engines serve on their own hosts' addresses; each joined its weight-update groups at
    the trainer host's address."""
    trainer = cluster.head.address
    engines = ENGINE_LINE.findall(text)
    assert sorted(ip for _, _, ip, _ in engines) == sorted(engine_hosts), engines
    for _, url, _, log_path in engines:
        masters = MASTER_LINE.findall(Path(log_path).read_text(errors="replace"))
        assert masters, f"{url} joined no weight-update group"
        assert set(masters) == {trainer}, f"{url} joined at {masters}, not {trainer}"
    assert "127.0.0.1" not in " ".join(url for _, url, _, _ in engines)


def test_broadcast_one_rollout_across_hosts(cluster, material, tmp_path):
    """Trainer (2 gloo ranks) on host a, one engine on host b, ``broadcast``: the rollout is
    generated, trained and published across hosts; a keyless request from host c is refused."""
    host_b, host_c = cluster.hosts[1], cluster.hosts[2]
    start = time.monotonic()
    text, records, answers = run_job(
        cluster,
        material,
        tmp_path,
        "--num-rollout", "1",
        "--update-weight-transfer-mode", "broadcast",
        "--save", str(tmp_path / "ckpt"), "--save-interval", "1",
        probe_from=host_c,
    )  # fmt: skip
    print(f"multi-host broadcast job: {time.monotonic() - start:.0f} s")
    assert [r["rollout_id"] for r in records] == [0]
    assert all(v >= 1 for v in records[0]["rollout"]["generated_with_versions"])
    check_addresses(cluster, text, [host_b.address])
    final = assert_publishes_verified(text, [1, 2], engines=1)
    assert final == fsdp_saved_state(tmp_path / "ckpt", 1)
    assert "generated a key for this job" in text
    assert answers == ["401"], answers


@pytest.mark.extended
# broadcast across hosts is the default suite's job (test_broadcast_one_rollout_across_hosts)
@pytest.mark.parametrize("mode", ["p2p", "disk-delta"])
def test_two_engines_on_two_hosts(cluster, material, tmp_path, mode):
    """Engines on hosts b and c, 2 rollouts: every publish reaches both hosts (one rising
    version per rollout); ``p2p`` groups are made by each trainer rank at host a's address;
    ``disk-delta`` runs one puller beside each engine, on its host (before, no puller ran and
    the first publish waited for them until its timeout)."""
    flags = ["--num-rollout", "2", "--rollout-num-gpus", "2", "--update-weight-transfer-mode", mode]
    flags += ["--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    if mode == "disk-delta":
        flags += ["--update-weight-disk-dir", str(tmp_path / "shared")]
    text, records, answers = run_job(
        cluster, material, tmp_path, *flags, probe_from=cluster.hosts[0]
    )
    versions = [r["rollout"]["generated_with_versions"] for r in records]
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert all(len(v) == 1 for v in versions) and versions[1][0] == versions[0][0] + 1, versions
    if mode == "disk-delta":
        pullers = re.findall(r"puller (\d+) for (http://[\d.]+:\d+)", text)
        assert sorted(k for k, _ in pullers) == ["0", "1"]
    else:
        check_addresses(cluster, text, [h.address for h in cluster.hosts[1:]])
    final = assert_publishes_verified(text, [1, 2, 3], engines=2)
    assert final == fsdp_saved_state(tmp_path / "ckpt", 2)
    assert answers == ["401"], answers


def megatron_flags(hf: Path, prompts: Path, metrics: Path) -> list[str]:
    """The megatron backend at TP=2 on the two trainer ranks (CPU shim: conftest.py)."""
    return [
        "--train-backend", "megatron", "--no-bf16", "--hf-checkpoint", str(hf),
        "--prompt-data", str(prompts), "--input-key", "prompt", "--label-key", "label",
        "--rm-type", "label-char-fraction", "--rollout-engine", "builtin",
        "--actor-num-nodes", "1", "--rollout-num-gpus", "1",
        "--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--rollout-temperature", "1.0", "--advantage-estimator", "grpo",
        "--micro-batch-size", "2", "--lr", "1e-2", "--weight-decay", "0.0", "--clip-grad", "1.0",
        "--metrics-jsonl", str(metrics),
    ]  # fmt: skip


@pytest.mark.extended
@pytest.mark.skipif("megatron" not in backends.available(), reason="megatron backend not installed")
def test_megatron_tp2_across_hosts(cluster, material, tmp_path):
    """Megatron TP=2 ranks on host a, one engine on host b, ``broadcast``, 2 rollouts: the
    engine joins the group at host a's address, every publish (the TP shards gathered into HF
    tensors by the trainer) is read back from host b bit for bit, and the last one is the saved
    checkpoint converted offline."""
    text, records, answers = run_job(
        cluster,
        material,
        tmp_path,
        "--num-rollout", "2",
        "--update-weight-transfer-mode", "broadcast",
        "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
        probe_from=cluster.hosts[2],
        base=megatron_flags,
    )  # fmt: skip
    versions = [r["rollout"]["generated_with_versions"] for r in records]
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert versions == [[1], [2]], versions
    check_addresses(cluster, text, [cluster.hosts[1].address])
    final = assert_publishes_verified(text, [1, 2, 3], engines=1)
    assert final == megatron_saved_state(tmp_path / "ckpt", material[0], tmp_path / "final-hf")
    assert answers == ["401"], answers
