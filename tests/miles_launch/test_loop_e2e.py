"""The loop end to end: ``miles train --train-backend fsdp`` on Ray with 2 gloo trainer ranks
and 1 built-in CPU engine (disaggregated), as subprocesses of the real CLI.

Slow (each job starts Ray, two trainer actors and an engine). The default suite keeps one
representative run, the demo smoke; the rest (colocated equals disaggregated, the ``--lr 0``
control, resume equivalence, ``--fully-async`` overlap, an engine killed mid-generation, a
trainer rank failing in init) are ``extended``, which CI runs too.
"""

from __future__ import annotations

import importlib.util
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
from miles_core import backends
from miles_core.checkpoint_layout import read_tracker, resolve_load
from miles_launch.demo import build_tiny_qwen3, demo_flags, write_demo_prompts
from train_runs import dcp_tensors

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        "fsdp" not in backends.available(), reason="the FSDP backend is not installed"
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("miles_sync.weight_sync") is None,
        reason="miles-sync's WeightPublisher (update_weights) is not installed",
    ),
]

ROOT = Path(__file__).resolve().parents[2]
LAST_LINE = re.compile(
    r"^demo: reward first-3 mean (\d+\.\d+) -> last-3 mean (\d+\.\d+) \((\d+) s\)$"
)
SMALL = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "4"]


@pytest.fixture(scope="module")
def material(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    return build_tiny_qwen3(root / "tiny-qwen3"), write_demo_prompts(root / "prompts.jsonl")


def train(
    material, metrics: Path, *flags: str, timeout: float = 600
) -> subprocess.CompletedProcess:
    hf, prompts = material
    cmd = [sys.executable, "-m", "miles_launch.train", *demo_flags(hf, prompts, metrics), *flags]
    return subprocess.run(
        cmd + ["--no-progress"], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def records(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if "rollout_id" in r]


def demo(tmp_path: Path, *flags: str) -> tuple[float, float, str]:
    result = subprocess.run(
        [
            sys.executable,
            "scripts/run_demo.py",
            "--output-dir",
            str(tmp_path),
            "--no-progress",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    match = LAST_LINE.match(last)
    assert match, last
    return float(match.group(1)), float(match.group(2)), result.stdout + result.stderr


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The CI smoke run of the demo: 2 rollouts, disaggregated."""
    out = tmp_path_factory.mktemp("smoke")
    return out, *demo(out, "--num-rollout", "2")


def _rollout_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if re.match(r"^rollout \d+: reward", line)]


def test_demo_smoke_two_rollouts(smoke):
    out_dir, _, _, out = smoke
    assert (out_dir / "run.png").read_bytes()[:4] == b"\x89PNG"
    assert f"demo: picture at {out_dir / 'run.png'}" in out
    # the script checked that the engine's weight version rose by one per rollout
    lines = _rollout_lines(out)
    assert [line.split(" (")[1] for line in lines] == [
        "generated with weight version [1])",
        "generated with weight version [2])",
    ]
    # the engine returned log-probs: each trained rollout reports the train/rollout mismatch
    trained = [r for r in records(out_dir / "metrics.jsonl") if r["rollout_id"] >= 0]
    assert len(trained) == 2
    for r in trained:
        assert 0.0 <= r["train"]["train_rollout_logprob_abs_diff"] < 1.0, r["train"]
        assert r["train"]["train_rollout_is_ratio_std"] >= 0.0
        t = r["train"]  # the extremes reach the JSONL beside the means
        assert t["train_rollout_logprob_abs_diff_max"] >= t["train_rollout_logprob_abs_diff"]
        ratio = t["train_rollout_is_ratio_mean"]
        assert t["train_rollout_is_ratio_min"] <= ratio <= t["train_rollout_is_ratio_max"]
        assert (
            0.0
            <= t["train_rollout_logprob_abs_diff_sample_max"]
            <= (t["train_rollout_logprob_abs_diff_max"])
        )


@pytest.mark.extended
def test_colocated_run_matches_the_disaggregated_one(smoke, tmp_path):
    """--colocate: 2 engines on the trainer's 2 slots, trainer asleep during generation,
    engine memory released during training, weights over IPC (shared memory on CPU). Same
    seeds and exact weight transfer: the same samples, so the same reward per rollout."""
    _, _, _, out = smoke
    _, _, colocated = demo(tmp_path, "--num-rollout", "2", "--colocate")
    assert "engines: 2 builtin engine(s) x 1 CPU slot, colocated" in colocated
    assert _rollout_lines(colocated) == _rollout_lines(out)


@pytest.mark.extended
def test_lr_zero_gives_no_rise(tmp_path):
    """Also evaluates with the EMA weights: each eval (the one before training included)
    publishes EMA, then the actor again."""
    evals = write_demo_prompts(tmp_path / "eval.jsonl", num_prompts=4, seed=7)
    first, last, out = demo(
        tmp_path, "--num-rollout", "6", "--lr", "0",
        "--eval-interval", "3", "--eval-prompt-data", "held-out", str(evals),
        "--use-ema", "--eval-weights", "ema",
    )  # fmt: skip
    eval_line = r"\| held-out \| reward_mean \d\.\d{4} \| response_len_mean \d+\.\d{4} \| pass@1 "
    assert re.search(r"^eval before training " + eval_line, out, re.M), out
    assert re.search(r"^eval after rollout 3 " + eval_line, out, re.M), out
    assert re.search(r"^eval after rollout 6 " + eval_line, out, re.M)
    versions = [int(line.split("[")[1].rstrip("])")) for line in _rollout_lines(out)]
    # one publish per rollout, plus two around each of the evals before training and after
    # rollout 3 (EMA, then the actor)
    assert versions == [3, 4, 5, 8, 9, 10], out
    # the learning demo climbs by >= 0.2 over 12 rollouts; without updates the policy is fixed
    assert first >= 0.05
    assert last < first + 0.1, out


#: the resume tests' job: 3 rollouts, saving at 2 and 3
RESUMABLE = [*SMALL, "--save-interval", "2", "--num-rollout", "3"]


@pytest.fixture(scope="module")
def straight_run(material, tmp_path_factory) -> Path:
    """The uninterrupted run the resume tests compare with: ``a.jsonl`` and ``ckpt/``."""
    root = tmp_path_factory.mktemp("straight")
    a = train(material, root / "a.jsonl", *RESUMABLE, "--save", str(root / "ckpt"))
    assert a.returncode == 0, a.stderr[-3000:]
    return root


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = dcp_tensors(a), dcp_tensors(b)
    assert wa.keys() == wb.keys() and len(wa) > 0
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


@pytest.mark.extended
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


@pytest.mark.extended
def test_fully_async_overlaps_generation_and_training(material, tmp_path):
    """PPO with a critic under --fully-async: each rollout's critic phase scores and trains
    before the actor (the first, --num-critic-only-steps 1, trains only the critic). On-policy
    only (--max-weight-staleness 0): groups a publish made stale are dropped and counted."""
    ppo = ["--advantage-estimator", "ppo", "--use-critic", "--num-critic-only-steps", "1"]
    result = train(
        material, tmp_path / "m.jsonl", *SMALL, "--num-rollout", "3", "--fully-async", *ppo,
        "--max-weight-staleness", "0",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rs = records(tmp_path / "m.jsonl")
    assert [r["rollout_id"] for r in rs] == [0, 1, 2]
    assert "loss" not in rs[0]["train"] and "critic/value_loss" in rs[0]["train"]
    for r in rs[1:]:
        assert {"loss", "critic/value_loss"} <= set(r["train"]), r["train"]
    for r in rs:
        stats = r["rollout"]
        assert 0.0 <= stats["overlap_s"] <= r["time"]["train"] + 1e-6
        assert stats["staleness_max"] == stats["staleness_mean"] == 0  # the bound held
        assert stats["stale_groups_dropped"] >= 0
    # generation ran during training (measured from request intervals), and is logged
    assert sum(r["rollout"]["overlap_s"] for r in rs) > 0
    assert "generation overlapped" in result.stderr
    assert "staleness" in result.stdout


def err_tail(lines: list[str]) -> str:
    return "".join(lines)[-3000:]


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


@pytest.mark.extended
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


@pytest.mark.extended
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


@pytest.mark.extended
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


@pytest.mark.extended
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


@pytest.mark.extended
def test_calculator_example_with_rollout_control(material, tmp_path):
    """examples/calculator_tool through ``miles train`` with over-sampling under the dynamic
    filter and the prompt-length limit: tool tokens are masked out of the loss, long prompts
    never drawn, each rollout full."""
    hf, _ = material
    example = ROOT / "examples" / "calculator_tool"
    sys.path.insert(0, str(example))
    try:
        import calculator
    finally:
        sys.path.remove(str(example))
    prompts = calculator.write_prompts(tmp_path / "prompts.jsonl", num_prompts=24)
    with open(prompts, "a", encoding="utf-8") as f:  # prompts 24..27: 28 tokens each
        for _ in range(4):
            f.write(json.dumps({"prompt": "add 1 2 " + "x" * 20, "label": "3"}) + "\n")
    metrics = tmp_path / "metrics.jsonl"
    flags = demo_flags(hf, prompts, metrics)
    for flag, value in (("--num-rollout", "2"), ("--rollout-max-response-len", "12")):
        flags[flags.index(flag) + 1] = value
    flags += [
        "--custom-generate-function-path", "calculator:generate",
        "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "4",
        "--dynamic-filter",
        "--over-sampling-batch-size", "4",
        "--rollout-max-prompt-len", "10",
    ]  # fmt: skip
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(example), os.environ.get("PYTHONPATH", "")])
    )
    result = subprocess.run(
        [sys.executable, "-m", "miles_launch.train", *flags, "--no-progress"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = records(metrics)
    assert [r["rollout_id"] for r in runs] == [0, 1]
    for r in runs:
        stats = r["rollout"]
        assert stats["prompts_too_long"] == 4 and len(r["prompt_ids"]) == 2
        assert not set(r["prompt_ids"]) & {24, 25, 26, 27}
        assert "groups_surplus" in stats and stats["draws"] >= 1
        assert stats["num_samples"] == 8
    assert min(r["rollout"]["loss_token_fraction"] for r in runs) < 1.0  # a tool was called


@pytest.mark.extended
def test_partial_rollout_carries_groups_between_rollouts(material, tmp_path):
    """``--partial-rollout`` through ``miles train``: what a rollout cuts short the next one
    resumes first, every rollout is full, and continued samples train (their continuation only:
    ``--mask-offpolicy-in-partial-rollout`` keeps the carried tokens out of the loss)."""
    metrics = tmp_path / "metrics.jsonl"
    result = train(
        material,
        metrics,
        "--num-rollout", "4",
        "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "64",
        "--dynamic-filter",
        "--over-sampling-batch-size", "8",
        "--partial-rollout",
        "--mask-offpolicy-in-partial-rollout",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    stats = [r["rollout"] for r in records(metrics)]
    assert len(stats) == 4 and all(s["num_samples"] == 8 for s in stats)
    assert stats[0]["groups_resumed"] == 0
    for before, after in zip(stats, stats[1:]):
        assert after["groups_resumed"] == before["groups_carried"]
    assert sum(s["groups_carried"] for s in stats[:-1]) >= 1
    assert sum(s["samples_continued"] for s in stats) >= 1
    # a rollout that continued samples trained fewer than all of its tokens (no tool masks here)
    continued = [s for s in stats if s["samples_continued"]]
    assert min(s["loss_token_fraction"] for s in continued) < 1.0
    assert all(s["loss_token_fraction"] == 1.0 for s in stats if not s["samples_continued"])
