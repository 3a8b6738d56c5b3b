"""Checkpoint layout: naming, tracker, meta.json, --load / --ckpt-step resolution, durability order."""

import json
import os
from importlib.metadata import version

import pytest
from miles_core import checkpoint_layout as cl
from miles_core.checkpoint_layout import CheckpointError, CheckpointMeta


def _meta(iteration: int, **overrides) -> CheckpointMeta:
    values = dict(
        iteration=iteration,
        rollout_id=iteration,
        next_rollout_id=iteration + 1,
        global_step=4 * (iteration + 1),
        micro_step=16 * (iteration + 1),
        world_size=2,
        backend="fsdp",
        extra={"ema_step": iteration},
    )
    values.update(overrides)
    return CheckpointMeta(**values)


def _save(save_dir, iteration: int, payload: bytes = b"weights") -> CheckpointMeta:
    """What a backend does: write its files into iter_*, then commit."""
    target = cl.iteration_dir(save_dir, iteration)
    (target / "model").mkdir(parents=True)
    (target / "model" / "shard_0.bin").write_bytes(payload)
    (target / "rng.pt").write_bytes(b"rng")
    meta = _meta(iteration)
    cl.commit_iteration(save_dir, iteration, meta)
    return meta


def test_iteration_naming():
    assert cl.iteration_dir_name(0) == "iter_0000000"
    assert cl.iteration_dir_name(1) == "iter_0000001"
    assert cl.iteration_dir_name(1234567) == "iter_1234567"
    assert cl.iteration_dir_name(12345678) == "iter_12345678"
    with pytest.raises(ValueError, match="-1"):
        cl.iteration_dir_name(-1)


def test_commit_then_resolve_round_trip(tmp_path):
    saved = _save(tmp_path, 3)
    assert (tmp_path / cl.TRACKER_FILENAME).read_text() == "3\n"
    resolved = cl.resolve_load(tmp_path)
    assert resolved.iteration == 3
    assert resolved.path == tmp_path / "iter_0000003"
    assert resolved.meta == saved
    assert resolved.meta.next_rollout_id == 4
    assert resolved.meta.extra == {"ema_step": 3}
    # Versions are the installed distributions', torch included.
    assert resolved.meta.versions["miles-core"] == version("miles-core")
    assert resolved.meta.versions["torch"] == version("torch")
    # Nothing but the tracker and the iteration is left in the save dir (no temp files).
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [cl.TRACKER_FILENAME, "iter_0000003"]
    )
    assert sorted(p.name for p in resolved.path.iterdir()) == ["meta.json", "model", "rng.pt"]


def test_meta_json_is_plain_json(tmp_path):
    _save(tmp_path, 1)
    data = json.loads((tmp_path / "iter_0000001" / "meta.json").read_text())
    assert data["iteration"] == 1
    assert data["global_step"] == 8
    assert data["backend"] == "fsdp"
    assert isinstance(data["timestamp"], float)


def test_tracker_follows_the_latest_commit_and_ckpt_step_goes_back(tmp_path):
    _save(tmp_path, 1, b"one")
    _save(tmp_path, 2, b"two")
    assert cl.resolve_load(tmp_path).iteration == 2
    older = cl.resolve_load(tmp_path, ckpt_step=1)
    assert older.iteration == 1
    assert (older.path / "model" / "shard_0.bin").read_bytes() == b"one"
    assert cl.list_iterations(tmp_path) == [1, 2]


def test_ckpt_step_absent_names_flag_and_dir(tmp_path):
    _save(tmp_path, 1)
    with pytest.raises(CheckpointError) as err:
        cl.resolve_load(tmp_path, ckpt_step=5)
    message = str(err.value)
    assert "--ckpt-step 5" in message
    assert str(tmp_path / "iter_0000005") in message
    assert "iterations in" in message and ": 1)" in message


@pytest.mark.parametrize("content", ["", "abc\n", "-3\n", "1.5\n", "2 3\n", "\u00b2\n"])
def test_corrupt_tracker_names_the_file(tmp_path, content):
    _save(tmp_path, 1)
    (tmp_path / cl.TRACKER_FILENAME).write_text(content)
    with pytest.raises(CheckpointError, match="latest_checkpointed_iteration.txt is corrupt"):
        cl.resolve_load(tmp_path)


def test_tracker_naming_a_missing_iteration(tmp_path):
    _save(tmp_path, 1)
    cl.write_tracker(tmp_path, 7)
    with pytest.raises(CheckpointError, match=r"names iteration 7, but .*iter_0000007"):
        cl.resolve_load(tmp_path)


def test_load_without_tracker_is_a_fresh_start(tmp_path):
    assert cl.resolve_load(tmp_path) is None
    # An iteration written but never committed is not a checkpoint.
    (tmp_path / "iter_0000001").mkdir()
    assert cl.resolve_load(tmp_path) is None


def test_load_missing_dir_names_the_flag(tmp_path):
    with pytest.raises(CheckpointError, match=r"--load directory .*nope does not exist"):
        cl.resolve_load(tmp_path / "nope")


def test_load_given_an_iteration_dir_points_to_the_parent(tmp_path):
    _save(tmp_path, 2)
    with pytest.raises(CheckpointError, match=r"parent directory.*--ckpt-step 2"):
        cl.resolve_load(tmp_path / "iter_0000002")
    # Also when the parent has no tracker: never a silent fresh start.
    (tmp_path / "other" / "iter_0000004").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"parent directory.*--ckpt-step 4"):
        cl.resolve_load(tmp_path / "other" / "iter_0000004")


def test_meta_validation_names_file_and_field(tmp_path):
    _save(tmp_path, 1)
    meta_path = tmp_path / "iter_0000001" / "meta.json"
    data = json.loads(meta_path.read_text())

    del data["next_rollout_id"]
    meta_path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"meta.json: missing field 'next_rollout_id'"):
        cl.resolve_load(tmp_path)

    data["next_rollout_id"] = True  # a bool is not a counter
    meta_path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"field 'next_rollout_id' must be int"):
        cl.resolve_load(tmp_path)

    data["next_rollout_id"] = 2
    data["written_by_a_newer_version"] = 1  # unknown keys are ignored
    meta_path.write_text(json.dumps(data))
    assert cl.resolve_load(tmp_path).meta.next_rollout_id == 2

    meta_path.write_text("{not json")
    with pytest.raises(CheckpointError, match=r"meta.json: not valid JSON"):
        cl.resolve_load(tmp_path)

    meta_path.unlink()
    with pytest.raises(CheckpointError, match=r"meta.json does not exist"):
        cl.resolve_load(tmp_path)


def test_meta_iteration_must_match_directory(tmp_path):
    _save(tmp_path, 1)
    cl.write_meta(tmp_path / "iter_0000001", _meta(9))
    with pytest.raises(CheckpointError, match="iteration 9 does not match"):
        cl.resolve_load(tmp_path)


def test_commit_refuses_a_missing_iteration_and_leaves_the_tracker(tmp_path):
    _save(tmp_path, 1)
    with pytest.raises(CheckpointError, match="iter_0000002 does not exist"):
        cl.commit_iteration(tmp_path, 2, _meta(2))
    with pytest.raises(ValueError, match="iteration 3 != iteration 2"):
        cl.commit_iteration(tmp_path, 2, _meta(3))
    assert cl.read_tracker(tmp_path) == 1


def test_prepare_clears_uncommitted_leftovers_and_protects_the_committed(tmp_path):
    _save(tmp_path, 1)
    stale = cl.iteration_dir(tmp_path, 2)
    (stale / "model").mkdir(parents=True)
    (stale / "model" / "shard_7.bin").write_bytes(b"from a crashed save with 8 ranks")
    fresh = cl.prepare_iteration_dir(tmp_path, 2)
    assert fresh == stale and list(fresh.iterdir()) == []
    assert cl.prepare_iteration_dir(tmp_path, 3).is_dir()
    with pytest.raises(CheckpointError, match="refusing to overwrite .*iter_0000001"):
        cl.prepare_iteration_dir(tmp_path, 1)
    assert (tmp_path / "iter_0000001" / "model" / "shard_0.bin").read_bytes() == b"weights"


def _record_fsyncs(monkeypatch) -> list[str]:
    """Spy on os.fsync (the OS call, not our code): the path of every descriptor synced."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name descriptors")
def test_commit_syncs_every_file_before_the_tracker(tmp_path, monkeypatch):
    synced = _record_fsyncs(monkeypatch)
    _save(tmp_path, 1)
    tracker = str(tmp_path / cl.TRACKER_FILENAME)
    iteration = tmp_path / "iter_0000001"
    must_precede = [str(p) for p in iteration.rglob("*")] + [str(iteration), str(tmp_path)]
    # The tracker is renamed into place, so its fsync is on the temp file: the last file
    # synced is that temp file, then the save dir (for the rename).
    assert os.path.basename(synced[-2]).startswith(f".{cl.TRACKER_FILENAME}.")
    assert synced[-1] == str(tmp_path)
    tracker_sync = len(synced) - 2
    for path in must_precede:
        assert path in synced[:tracker_sync], f"{path} not fsync'd before the tracker"
    assert tracker not in synced[:tracker_sync]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name descriptors")
def test_fsync_tree_covers_files_and_directories(tmp_path, monkeypatch):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "x.bin").write_bytes(b"x")
    (tmp_path / "y.bin").write_bytes(b"y")
    os.symlink(tmp_path / "y.bin", tmp_path / "link")
    synced = _record_fsyncs(monkeypatch)
    cl.fsync_tree(tmp_path)
    expected = {str(p) for p in tmp_path.rglob("*") if not p.is_symlink()} | {str(tmp_path)}
    assert set(synced) == expected
    # Bottom-up: a directory after everything inside it.
    assert synced.index(str(tmp_path / "a" / "b" / "x.bin")) < synced.index(str(tmp_path / "a"))
    assert synced[-1] == str(tmp_path)
