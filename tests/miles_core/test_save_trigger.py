"""--save-trigger-sentinel: the save-point decision, consumption, and a crash injected mid-save."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from miles_core import checkpoint_layout as cl
from miles_core.save_trigger import SaveTrigger, agree_on_all_ranks, should_save
from rank_context import in_environ, rank_context


def test_pending_arms_and_consume_deletes(tmp_path):
    sentinel = tmp_path / "save_now"
    trigger = SaveTrigger(sentinel)
    assert not trigger.pending() and not trigger.armed
    assert not trigger.consume()  # nothing armed: nothing to delete
    sentinel.touch()
    assert not trigger.consume()  # not armed yet: a file seen by no save point stays
    assert sentinel.exists()
    assert trigger.pending() and trigger.armed
    assert trigger.consume()
    assert not sentinel.exists() and not trigger.armed


def test_request_renewed_during_the_save_stays_pending(tmp_path):
    sentinel = tmp_path / "save_now"
    sentinel.touch()
    os.utime(sentinel, ns=(1_000_000_000, 1_000_000_000))
    trigger = SaveTrigger(sentinel)
    assert trigger.pending()
    # While the checkpoint is written, someone touches the file again.
    os.utime(sentinel, ns=(2_000_000_000, 2_000_000_000))
    assert not trigger.consume()
    assert sentinel.exists()
    # The next save point takes it.
    assert trigger.pending() and trigger.consume()
    assert not sentinel.exists()


def test_request_deleted_by_hand_during_the_save(tmp_path):
    sentinel = tmp_path / "save_now"
    sentinel.touch()
    trigger = SaveTrigger(sentinel)
    assert trigger.pending()
    sentinel.unlink()
    assert not trigger.consume()


@pytest.mark.parametrize(
    ("rollout_id", "interval", "last", "expected"),
    [
        (0, 2, None, False),
        (1, 2, None, True),  # (1 + 1) % 2 == 0
        (3, 2, None, True),
        (4, 2, None, False),
        (4, 2, 4, True),  # the final rollout is kept when saving by interval
        (4, None, 4, True),  # no interval: the final rollout is still kept
        (3, None, 4, False),  # no interval: nothing before it (but the sentinel)
        (5, 0, None, False),
        (0, 1, None, True),
    ],
)
def test_should_save_by_interval(rollout_id, interval, last, expected):
    assert should_save(rollout_id, interval, None, last_rollout_id=last) is expected


def test_should_save_on_request_whatever_the_interval(tmp_path):
    sentinel = tmp_path / "save_now"
    trigger = SaveTrigger(sentinel)
    assert not should_save(0, None, trigger)
    assert not trigger.armed
    sentinel.touch()
    assert should_save(0, None, trigger)
    assert should_save(0, 1000, trigger)
    assert trigger.armed
    with pytest.raises(ValueError, match="--save-interval"):
        should_save(0, -1, trigger)


def _agree_worker(rank: int, world_size: int, tmp: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=world_size
    )
    try:
        # Rank 0 saw the sentinel, rank 1 looked a moment earlier; then the reverse.
        seen = (agree_on_all_ranks(rank == 0), agree_on_all_ranks(rank != 0))
        with open(f"{tmp}/rank{rank}", "w") as out:
            out.write(repr(seen))
    finally:
        dist.destroy_process_group()


def test_agree_on_all_ranks_takes_rank_zero_view(tmp_path):
    assert agree_on_all_ranks(True) is True  # no process group: the local decision
    ctx = rank_context()
    procs = [
        ctx.Process(target=in_environ(_agree_worker), args=(r, 2, str(tmp_path))) for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=90)
        if p.exitcode is None:
            p.kill()
        assert p.exitcode == 0
    for rank in range(2):
        assert (tmp_path / f"rank{rank}").read_text() == "(True, False)"


# A save point as the loop runs it, in a process we kill at a chosen moment. The kill is a
# real SIGKILL: nothing after it (no finally, no atexit) runs.
SAVE_POINT = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from miles_core import checkpoint_layout as cl
    from miles_core.save_trigger import SaveTrigger, should_save

    save_dir, sentinel, kill_at = sys.argv[1:4]

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    if kill_at == "before_tracker":  # iteration and meta written and fsync'd, tracker not begun
        cl.write_tracker = die
    elif kill_at == "tracker_rename":  # tracker temp file written, not yet renamed into place
        real_replace = os.replace
        def replace(src, dst):
            if Path(dst).name == cl.TRACKER_FILENAME:
                die()
            return real_replace(src, dst)
        os.replace = replace
    elif kill_at == "before_consume":  # checkpoint durable, sentinel not yet deleted
        SaveTrigger.consume = die

    trigger = SaveTrigger(sentinel)
    rollout_id = 1
    assert should_save(rollout_id, 1000, trigger)  # only the sentinel asks
    target = cl.iteration_dir(save_dir, 2)
    (target / "model").mkdir(parents=True, exist_ok=True)
    (target / "model" / "shard_0.bin").write_bytes(b"two" * 1000)
    meta = cl.CheckpointMeta(iteration=2, rollout_id=rollout_id, next_rollout_id=2,
                             global_step=2, micro_step=8, world_size=1, backend="fsdp")
    cl.commit_iteration(save_dir, 2, meta)
    trigger.consume()
    print("saved")
    """
)


def _run_save_point(tmp_path, kill_at: str) -> subprocess.CompletedProcess:
    script = tmp_path / "save_point.py"
    script.write_text(SAVE_POINT)
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt"), str(tmp_path / "save_now"), kill_at],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _committed_first_iteration(tmp_path) -> None:
    save_dir = tmp_path / "ckpt"
    (cl.iteration_dir(save_dir, 1) / "model").mkdir(parents=True)
    (cl.iteration_dir(save_dir, 1) / "model" / "shard_0.bin").write_bytes(b"one")
    meta = cl.CheckpointMeta(
        iteration=1,
        rollout_id=0,
        next_rollout_id=1,
        global_step=1,
        micro_step=4,
        world_size=1,
        backend="fsdp",
    )
    cl.commit_iteration(save_dir, 1, meta)


@pytest.mark.parametrize("kill_at", ["before_tracker", "tracker_rename"])
def test_crash_mid_save_keeps_previous_iteration_and_the_request(tmp_path, kill_at):
    _committed_first_iteration(tmp_path)
    (tmp_path / "save_now").touch()

    crashed = _run_save_point(tmp_path, kill_at)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    assert "saved" not in crashed.stdout
    # The new iteration was written (the crash came after it) ...
    assert (tmp_path / "ckpt" / "iter_0000002" / "meta.json").exists()
    # ... but the previous one is what --load resumes, intact.
    resolved = cl.resolve_load(tmp_path / "ckpt")
    assert resolved.iteration == 1
    assert resolved.meta.next_rollout_id == 1
    assert (resolved.path / "model" / "shard_0.bin").read_bytes() == b"one"
    # The request survives for the next run.
    assert (tmp_path / "save_now").exists()
    # A rename killed midway leaves its (harmless, hidden) temp file; nothing else is left.
    hidden = [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".")]
    if kill_at == "tracker_rename":
        assert len(hidden) == 1 and hidden[0].startswith(f".{cl.TRACKER_FILENAME}.")
    else:
        assert hidden == []

    # The next run takes the pending request, commits, and only then deletes the file.
    rerun = _run_save_point(tmp_path, "none")
    assert rerun.returncode == 0, rerun.stderr
    assert cl.resolve_load(tmp_path / "ckpt").iteration == 2
    assert not (tmp_path / "save_now").exists()


def test_crash_after_commit_before_consume_keeps_the_request(tmp_path):
    _committed_first_iteration(tmp_path)
    (tmp_path / "save_now").touch()
    crashed = _run_save_point(tmp_path, "before_consume")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    # The checkpoint is durable; the request was not yet acknowledged, so it stays (a second
    # save at the next run is harmless; a lost request is not).
    assert cl.resolve_load(tmp_path / "ckpt").iteration == 2
    assert (tmp_path / "save_now").exists()
