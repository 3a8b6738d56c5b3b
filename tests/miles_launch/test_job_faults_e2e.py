"""Jobs that fail, end to end (``miles train --train-backend fsdp`` on Ray, 2 gloo trainer
ranks, built-in CPU engines, subprocesses of the real CLI; all ``extended``): a resume equals an
uninterrupted run; an engine SIGKILLed mid-generation ends the run in one line
(``--engine-restart-limit 0``) or is restarted and the rollout completes; a trainer rank failing
in init, or SIGKILLed in train or in a publish, ends the run in one line, and ``--load`` resumes
the latter two bit for bit (no engine serves the partly published version). The processes
killed are always the test's own job's (descendants of its driver).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from demo_jobs import (
    REQUIRES,
    RESUMABLE,
    ROOT,
    SMALL,
    assert_same_weights,
    err_tail,
    records,
    train,
)
from miles_core.checkpoint_layout import read_tracker, resolve_load
from miles_launch.demo import demo_flags
from train_runs import dcp_tensors

pytestmark = [pytest.mark.slow, pytest.mark.extended, *REQUIRES]


@pytest.fixture(scope="module")
def straight_run(material, tmp_path_factory) -> Path:
    """The uninterrupted run the resume tests compare with: ``a.jsonl`` and ``ckpt/``."""
    root = tmp_path_factory.mktemp("straight")
    a = train(material, root / "a.jsonl", *RESUMABLE, "--save", str(root / "ckpt"))
    assert a.returncode == 0, a.stderr[-3000:]
    return root


def test_resume_matches_an_uninterrupted_run(material, straight_run, tmp_path):
    """3 rollouts straight (saving at 2 and 3) vs a restart from that run's checkpoint at 2
    (``--ckpt-step 2``, while its tracker says 3) that trains the third rollout again."""
    straight, resumed = straight_run / "ckpt", tmp_path / "resumed"
    b = train(
        material, tmp_path / "b.jsonl", *RESUMABLE,
        "--save", str(resumed), "--load", str(straight), "--ckpt-step", "2",
    )  # fmt: skip
    assert b.returncode == 0, b.stderr[-3000:]

    ra, rb = records(straight_run / "a.jsonl"), records(tmp_path / "b.jsonl")
    assert [r["rollout_id"] for r in ra] == [0, 1, 2] and [r["rollout_id"] for r in rb] == [2]
    assert rb[0]["prompt_ids"] == ra[2]["prompt_ids"]
    assert [r["data_position"] for r in ra] == [0, 4, 8] and rb[0]["data_position"] == 8
    assert json.loads((straight / "launcher" / "iter_0000002.json").read_text()) == {
        "next_rollout_id": 2,
        "data_position": 8,
    }
    # the last rollout's save
    assert_same_weights(straight / "iter_0000003" / "model", resumed / "iter_0000003" / "model")
    # and training moved the weights (the comparison is not between two untouched models)
    wa = dcp_tensors(straight / "iter_0000003" / "model")
    w0 = dcp_tensors(straight / "iter_0000002" / "model")
    assert any(not torch.equal(w0[n], wa[n]) for n in wa)


def resume_matches_the_straight_run(material, straight_run: Path, save: Path, tmp_path) -> None:
    """The end of both trainer-kill tests: the killed job's checkpoint at 2 is whole (its
    tracker says 2, nothing of 3 was written), and ``--load`` from it trains the third rollout
    (same prompts, same data position) to the straight run's weights bit for bit."""
    assert read_tracker(save) == 2 and not (save / "iter_0000003").exists()
    resolved = resolve_load(save)
    assert resolved.iteration == 2 and resolved.meta.next_rollout_id == 2
    resumed = train(
        material, tmp_path / "r.jsonl", *RESUMABLE,
        "--load", str(save), "--save", str(tmp_path / "again"),
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (r,) = records(tmp_path / "r.jsonl")
    straight = records(straight_run / "a.jsonl")
    assert (r["rollout_id"], r["data_position"]) == (2, 8)
    assert r["prompt_ids"] == straight[2]["prompt_ids"]
    assert_same_weights(
        straight_run / "ckpt" / "iter_0000003" / "model",
        tmp_path / "again" / "iter_0000003" / "model",
    )


def _wait_for_requests(pid: int, deadline: float) -> bool:
    """Whether the engine of ``pid`` reports running requests before ``deadline`` (its port
    from its command line, its API key from its environment)."""
    import httpx

    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    port = argv[argv.index("--port") + 1]
    environ = dict(
        item.split("=", 1)
        for item in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
        if "=" in item
    )
    key = environ.get("MILES_ENGINE_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    while time.monotonic() < deadline:
        try:
            info = httpx.get(
                f"http://127.0.0.1:{port}/get_server_info", headers=headers, timeout=10
            ).json()
            if info.get("num_requests", 0) > 0:
                return True
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.05)
    return False


def _engine_pids(marker: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in cmdline]
        if "miles_launch.builtin_engine" in args and marker in args:
            pids.append(int(entry))
    return pids


def kill_an_engine_mid_generation(
    hf: Path, cmd: list[str], engines: int, timeout: float = 300
) -> tuple[int, str, str]:
    """Run ``cmd`` (a ``miles train`` job of ``engines`` built-in engines), SIGKILL engine
    0 once its first generation is under way, and wait for the job's end: (exit status,
    stdout, stderr)."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    stderr: list[str] = []
    stdout: list[str] = []
    reader = threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        ready = False
        for line in proc.stdout:
            stdout.append(line)
            if line.startswith("engines ready"):
                ready = True
                break
        assert ready, f"the run ended before its engines were ready: {err_tail(stderr)}"
        pids = [pid for pid in _engine_pids(str(hf)) if _descends_from(pid, proc.pid)]
        assert len(pids) == engines, (pids, err_tail(stderr))
        victim = next(pid for pid in pids if _engine_log(pid) == "engine-0")
        # Kill it once its generation is under way (a state, not a delay: on any machine the
        # kill lands while /generate requests are in flight)
        assert _wait_for_requests(victim, deadline=time.monotonic() + 120), err_tail(stderr)
        os.kill(victim, signal.SIGKILL)
        stdout.append(proc.stdout.read())
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=30)
    return code, "".join(stdout), "".join(stderr)


def _engine_log(pid: int) -> str:
    """``engine-K``: the name of the log the engine of ``pid`` writes to (its stdout)."""
    return Path(os.readlink(f"/proc/{pid}/fd/1")).stem


def test_engine_killed_mid_generation_is_a_clear_error(material, tmp_path):
    """--engine-restart-limit 0: a dead engine ends the run, as before restarts existed."""
    hf, prompts = material
    cmd = [
        sys.executable, "-m", "miles_launch.train",
        *demo_flags(hf, prompts, tmp_path / "m.jsonl"),
        "--rollout-max-response-len", "120", "--num-rollout", "3", "--no-progress",
        "--engine-restart-limit", "0",
    ]  # fmt: skip
    code, _, err = kill_an_engine_mid_generation(hf, cmd, engines=1)
    assert code == 1, err[-3000:]
    assert re.search(
        r"error: engine 0 \(http://127\.0\.0\.1:\d+, pid \d+\) killed by SIGKILL "
        r"during generation",
        err,
    ), err[-3000:]
    assert "last lines of" in err and "engine-0.log" in err
    assert "Traceback" not in err.split("error: engine 0")[1]


def test_a_killed_engine_is_restarted_and_the_rollout_completes(material, tmp_path):
    """Two engines; engine 0 is SIGKILLed with requests in flight. The groups it held go to
    engine 1, the rollout completes with every sample (one group of n per prompt, one weight
    version each), engine 0 is restarted on its placement and, after the next publish, holds
    the trainer's weights bit for bit (--update-weight-verify reads every tensor back through
    /get_weights_by_name) and generates the next rollout beside engine 1."""
    hf, prompts = material
    dump = tmp_path / "rollout_{rollout_id}.pt"
    cmd = [
        sys.executable, "-m", "miles_launch.train",
        *demo_flags(hf, prompts, tmp_path / "m.jsonl"), *SMALL,
        "--rollout-num-gpus", "2", "--rollout-max-response-len", "120", "--num-rollout", "2",
        "--update-weight-verify", "--engine-restart-backoff", "0",
        "--save-debug-rollout-data", str(dump), "--no-progress",
    ]  # fmt: skip
    code, out, err = kill_an_engine_mid_generation(hf, cmd, engines=2)
    assert code == 0, err[-3000:]
    rs = records(tmp_path / "m.jsonl")
    assert [r["rollout_id"] for r in rs] == [0, 1]
    assert rs[0]["rollout"]["engine_restarts"] == 1, rs[0]["rollout"]
    assert rs[1]["rollout"]["engine_restarts"] == 0
    reissued = rs[0]["rollout"]["requests_reissued"]
    assert reissued > 0 and reissued % 4 == 0  # whole groups of --n-samples-per-prompt 4
    for r in rs:
        assert r["rollout"]["num_samples"] == 16
        assert len(r["rollout"]["generated_with_versions"]) == 1
        data = torch.load(str(dump).format(rollout_id=r["rollout_id"]), weights_only=True)
        groups = [s["group_index"] for s in data["samples"]]
        assert sorted(groups) == sorted(list(range(4)) * 4), groups  # every sample once
    assert re.search(r"engine 0 \(http://127\.0\.0\.1:\d+, pid \d+\) killed by SIGKILL during "
                     r"generation: restarting it", err), err[-3000:]  # fmt: skip
    assert "engine 0 restarted at http://127.0.0.1:" in err
    # every publish after the restart reached both engines and was read back bit for bit
    verified = re.findall(r"weight version (\d+) verified: \d+ tensors on (\d+) engines", err)
    assert verified and all(engines == "2" for _, engines in verified), verified
    assert verified[-1][0] == str(rs[-1]["weight_version"])


def test_trainer_rank_failure_tears_down_with_one_error(material, tmp_path):
    """A corrupt weights file fails backend.init on a rank: every rank is killed, the run
    exits 1 with one error naming the rank and the method, and no engine is left behind."""
    import shutil

    hf, prompts = material
    broken = tmp_path / "broken"
    shutil.copytree(hf, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    result = train((broken, prompts), tmp_path / "m.jsonl", "--num-rollout", "1", timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert re.search(r"^error: trainer rank \d on [\d.]+ failed in init\(\): ", result.stderr, re.M)
    assert "model.safetensors" in result.stderr.split("error: trainer rank")[1]
    assert _engine_pids(str(broken)) == []


def _parent(pid: int) -> int:
    """The parent pid of ``pid`` (0 when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])


def _descends_from(pid: int, root: int) -> bool:
    while pid > 1:
        if pid == root:
            return True
        pid = _parent(pid)
    return False


def _ranks_in(method: str, job: int) -> list[int]:
    """Pids of the trainer rank processes of the job whose driver is ``job`` (its local Ray's
    raylet, and so its workers, descend from it) running ``method`` now: Ray titles a worker
    ``ray::TrainerRank.<method>`` while it runs one. Other jobs on the machine are left
    alone."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                title = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if title.startswith(f"ray::TrainerRank.{method}".encode()):
                if _descends_from(int(entry), job):
                    pids.append(int(entry))
    return pids


def test_trainer_rank_killed_in_train_ends_in_one_line_and_resumes_bit_for_bit(
    material, straight_run, tmp_path
):
    """The straight run's job again, a rank SIGKILLed while it trains the third rollout (after
    the checkpoint of the second): the run ends with one line naming the rank, its host and the
    phase; the checkpoint at 2 is whole, and --load from it trains the third rollout to the
    straight run's weights bit for bit."""
    hf, prompts = material
    save = tmp_path / "ckpt"
    cmd = [
        sys.executable, "-m", "miles_launch.train",
        *demo_flags(hf, prompts, tmp_path / "k.jsonl"), *RESUMABLE,
        "--save", str(save), "--no-progress",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    stderr: list[str] = []
    reader = threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        for line in proc.stdout:  # rollout 1 reported: the checkpoint at 2 is written
            if line.startswith("rollout 2/3 |"):
                break
        else:
            pytest.fail(f"the run ended before its second rollout: {err_tail(stderr)}")
        deadline = time.monotonic() + 300
        while not (
            victims := _ranks_in("train", proc.pid)
        ):  # a state: the third rollout's training
            assert time.monotonic() < deadline and proc.poll() is None, err_tail(stderr)
            time.sleep(0.02)
        os.kill(victims[0], signal.SIGKILL)
        proc.stdout.read()
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=30)
    err = "".join(stderr)
    assert code == 1, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err[-3000:]
    assert re.match(
        r"^error: trainer rank \d on [\d.]+ failed in train\(\): its process died \(", errors[0]
    ), errors[0]
    assert "Traceback" not in err.split(errors[0])[1]
    resume_matches_the_straight_run(material, straight_run, save, tmp_path)


def _rank_pids(stderr: list[str], job: subprocess.Popen, deadline: float) -> list[int]:
    """The trainer ranks' pids in rank order, from the job's ``trainer ranks: 0 on HOST pid P,
    ...`` log line."""
    while True:
        found = re.search(r"trainer ranks: ((?:\d+ on \S+ pid \d+(?:, )?)+)", "".join(stderr))
        if found:
            ranks = re.findall(r"(\d+) on \S+ pid (\d+)", found.group(1))
            assert [int(r) for r, _ in ranks] == list(range(len(ranks))), found.group(0)
            return [int(pid) for _, pid in ranks]
        assert time.monotonic() < deadline and job.poll() is None, err_tail(stderr)
        time.sleep(0.05)


def _engine_state(url: str) -> tuple[str, bool] | None:
    """(weight version, paused) as the engine at ``url`` reports them; None once it is gone."""
    import httpx

    try:
        info = httpx.get(f"{url}/get_server_info", timeout=10).json()
    except httpx.TransportError:
        return None
    return str(info["weight_version"]), bool(info["paused"])


def test_trainer_rank_killed_in_publish_ends_in_one_line_and_no_engine_serves_part_of_it(
    material, straight_run, tmp_path
):
    """The straight run's job again, trainer rank 0 (the rank that drives the publish round on
    the engines) SIGKILLed in ``update_weights`` after the second rollout's training and save,
    once the round is open on the engine (it reports itself paused: buckets of version 3 may
    have landed) and before the round committed (it still reports version 2). The run ends
    with one line naming the rank, its host and the phase; until the engine stops it reports
    version 2, the last complete one, and stays paused (no decode step on a mix of versions);
    the checkpoint at 2 is whole, and --load from it trains the third rollout to the straight
    run's weights bit for bit."""
    hf, prompts = material
    save = tmp_path / "ckpt"
    cmd = [
        sys.executable, "-m", "miles_launch.train",
        *demo_flags(hf, prompts, tmp_path / "k.jsonl"), *RESUMABLE,
        "--save", str(save), "--no-progress",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    stderr: list[str] = []
    reader = threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True)
    reader.start()
    states: list[tuple[str, bool]] = []  # the engine's, from the kill until it stopped
    try:
        for line in proc.stdout:  # rollout 0 reported: the next publish follows the save at 2
            if line.startswith("rollout 1/3 |"):
                assert "version 2 |" in line, line
                break
        else:
            pytest.fail(f"the run ended before its first rollout: {err_tail(stderr)}")
        deadline = time.monotonic() + 300
        rank0 = _rank_pids(stderr, proc, deadline)[0]
        (engine,) = [pid for pid in _engine_pids(str(hf)) if _descends_from(pid, proc.pid)]
        argv = Path(f"/proc/{engine}/cmdline").read_bytes().decode().split("\0")
        url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
        # A state, not a delay: the round of version 3 is open on the engine (paused), after
        # the second rollout's training and save
        while (state := _engine_state(url)) != ("2", True):
            assert state is None or state[0] == "2", f"the round was missed: {state}"
            assert time.monotonic() < deadline and proc.poll() is None, (state, err_tail(stderr))
            time.sleep(0.005)
        os.kill(rank0, signal.SIGSTOP)  # frozen: it commits nothing more
        title = Path(f"/proc/{rank0}/cmdline").read_bytes()
        assert title.startswith(b"ray::TrainerRank.update_weights"), title
        assert _engine_state(url) == ("2", True)  # not committed before the freeze
        os.kill(rank0, signal.SIGKILL)
        while (state := _engine_state(url)) is not None:
            states.append(state)
            time.sleep(0.05)
        proc.stdout.read()
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=30)
    err = "".join(stderr)
    assert code == 1, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err[-3000:]
    assert re.match(
        r"^error: trainer rank 0 on [\d.]+ failed in update_weights\(\): its process died \(",
        errors[0],
    ), errors[0]
    assert f"pid: {rank0}" in errors[0]
    assert "Traceback" not in err.split(errors[0])[1]
    # the engine never served the partial version 3: version 2, paused, until it stopped
    assert states and set(states) == {("2", True)}, states
    rs = records(tmp_path / "k.jsonl")
    assert [(r["rollout_id"], r["weight_version"]) for r in rs] == [(0, "2")]
    resume_matches_the_straight_run(material, straight_run, save, tmp_path)
