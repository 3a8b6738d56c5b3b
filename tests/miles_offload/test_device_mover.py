"""DeviceMover on an ordinary (unsharded) model, CPU mode: the "device" is host memory and a
sleep really moves the bytes into the arena (or a file) and back."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from miles_offload.device_mover import DeviceMover
from miles_offload.offload_target import OffloadTarget
from offload_fsdp_model import build, train_step


def _trained(seed: int = 0):
    model = build(seed, shard=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt, 0, 0)
    return model, opt


def _values(model, opt):
    out = {f"p.{n}": p.detach().clone() for n, p in model.named_parameters()}
    out.update({f"b.{n}": b.clone() for n, b in model.named_buffers()})
    for i, p in enumerate(opt.param_groups[0]["params"]):
        out.update({f"s.{i}.{k}": v.clone() for k, v in opt.state[p].items()})
    return out


def _assert_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_cpu_round_trip_preserves_objects_ties_and_bits():
    model, opt = _trained()
    before = _values(model, opt)
    ids = [id(p) for p in model.parameters()]
    ptrs = [p.data_ptr() for p in model.parameters()]
    model(torch.zeros(1, 2, dtype=torch.long)).sum().backward()  # a stale gradient
    mover = DeviceMover({"actor": model}, [opt])
    stats = mover.sleep()
    store = mover._groups[0].store
    assert all(store.owns(p) for p in model.parameters())  # storage really moved
    assert all(p.grad is None for p in model.parameters())  # cleared, not moved
    assert mover._groups[1].store.owns(opt.state[model.embed.weight]["exp_avg"])
    assert stats.bytes_copied == sum(v.numel() * v.element_size() for v in before.values())
    host = mover.host_bytes
    mover.wake_up()
    assert [id(p) for p in model.parameters()] == ids
    assert not any(store.owns(p) for p in model.parameters())
    assert model.head.weight is model.embed.weight
    assert list(opt.state) == list(opt.param_groups[0]["params"])
    _assert_equal(before, _values(model, opt))
    # the second cycle reuses the arena: no new pinned memory
    again = mover.sleep()
    assert again.new_host_bytes == 0 and mover.host_bytes == host
    assert [p.data_ptr() for p in model.parameters()] != ptrs
    mover.wake_up()
    _assert_equal(before, _values(model, opt))
    mover.close()


def test_idempotent_and_close_wakes():
    model, opt = _trained()
    before = _values(model, opt)
    mover = DeviceMover({"actor": model}, [opt])
    assert mover.wake_up().bytes_copied == 0  # awake already
    mover.sleep()
    ptr = model.embed.weight.data_ptr()
    assert mover.sleep().bytes_copied > 0  # asleep already: the last stats, nothing new moved
    assert model.embed.weight.data_ptr() == ptr
    mover.close()
    assert not mover.is_asleep
    _assert_equal(before, _values(model, opt))
    with pytest.raises(RuntimeError, match="closed"):
        mover.sleep()


def test_optimizer_state_created_after_first_sleep_grows_the_arena():
    model = build(0, shard=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mover = DeviceMover({"actor": model}, [opt])
    mover.sleep()
    mover.wake_up()
    train_step(model, opt, 0, 0)
    before = _values(model, opt)
    assert mover.sleep().new_host_bytes > 0
    mover.wake_up()
    _assert_equal(before, _values(model, opt))


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_training_after_three_cycles_equals_training_without(tmp_path, kind):
    reference, ref_opt = _trained(5)
    model, opt = _trained(5)
    mover = DeviceMover(
        {"actor": model}, [opt], OffloadTarget(kind=kind, disk_dir=str(tmp_path), chunk_mb=1)
    )
    for step in range(1, 4):
        mover.sleep()
        mover.wake_up()
        train_step(model, opt, step, 0)
        train_step(reference, ref_opt, step, 0)
    _assert_equal(_values(reference, ref_opt), _values(model, opt))
    mover.close()


def test_disk_round_trip_frees_storage_and_removes_files(tmp_path):
    model, opt = _trained()
    before = _values(model, opt)
    target = OffloadTarget(kind="disk", disk_dir=str(tmp_path), chunk_mb=1, ring_chunks=2)
    mover = DeviceMover({"actor": model}, [opt], target)
    stats = mover.sleep()
    assert stats.bytes_copied >= sum(v.numel() * v.element_size() for v in before.values())
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    paths = mover.disk_paths
    assert len(paths) == 2 and all(os.path.getsize(p) % 4096 == 0 for p in paths)
    assert all("rank0" in os.path.basename(p) for p in paths)
    assert mover.host_bytes == 2 * 2 * (1 << 20)  # two files, each a ring of 2 x 1 MiB
    mover.wake_up()
    _assert_equal(before, _values(model, opt))
    mover.close()
    assert not any(os.path.exists(p) for p in paths)


def test_enospc_names_the_file_and_leaves_the_model_intact(tmp_path):
    model, opt = _trained()
    before = _values(model, opt)
    # the actor's file is a link to /dev/full: every write fails with ENOSPC
    path = tmp_path / f"miles-offload-{os.getpid()}-rank0-actor.bin"
    os.symlink("/dev/full", path)
    mover = DeviceMover(
        {"actor": model}, [opt], OffloadTarget(kind="disk", disk_dir=str(tmp_path), chunk_mb=1)
    )
    with pytest.raises(OSError) as info:
        mover.sleep()
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(path)
    assert "at offset 0" in str(info.value)
    assert not mover.is_asleep
    _assert_equal(before, _values(model, opt))
    train_step(model, opt, 1, 0)  # still trainable


EFBIG_SCRIPT = textwrap.dedent(
    """
    import json, resource, signal, sys, torch
    sys.path.insert(0, sys.argv[2])
    from offload_fsdp_model import build
    from miles_offload.device_mover import DeviceMover
    from miles_offload.offload_target import OffloadTarget
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (12288, 12288))
    model = torch.nn.Linear(64, 200)
    before = [p.detach().clone() for p in model.parameters()]
    mover = DeviceMover({"actor": model}, [], OffloadTarget(kind="disk", disk_dir=sys.argv[1], chunk_mb=1))
    try:
        mover.sleep()
        out = {"raised": False}
    except OSError as e:
        out = {"raised": True, "errno": e.errno, "filename": e.filename, "message": str(e),
               "offset": e.offset, "asleep": mover.is_asleep,
               "intact": all(torch.equal(a, b) for a, b in zip(before, model.parameters()))}
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_file_size_limit_short_write_raises_with_offset(tmp_path):
    here = os.path.dirname(__file__)
    proc = subprocess.run(
        [sys.executable, "-c", EFBIG_SCRIPT, str(tmp_path), here],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["raised"] and out["errno"] == errno.EFBIG
    assert out["filename"].startswith(str(tmp_path)) and out["offset"] == 12288
    assert "offset 12288" in out["message"]
    assert not out["asleep"] and out["intact"]


def test_tmpfs_disk_dir_warns(caplog):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as d, caplog.at_level(logging.WARNING):
        model, opt = _trained()
        mover = DeviceMover({"actor": model}, [opt], OffloadTarget(kind="disk", disk_dir=d))
        mover.sleep()
        mover.close()
    assert any("tmpfs" in r.getMessage() for r in caplog.records)


def test_frozen_names_must_be_models():
    model, _ = _trained()
    with pytest.raises(ValueError, match="frozen"):
        DeviceMover({"actor": model}, frozen={"ref"})


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_read_while_asleep_gives_the_values_without_waking(tmp_path, kind):
    """``read``: every parameter, buffer and optimizer state value (and a strided view of one)
    comes back bit for bit from the arena or the file; the mover stays asleep and the disk
    storages stay freed."""
    model, opt = _trained()
    before = _values(model, opt)
    view = model.embed.weight.detach()[1:, ::2]  # a strided view, made while awake
    view_before = view.clone()
    target = OffloadTarget(kind=kind, disk_dir=str(tmp_path) if kind == "disk" else None)
    mover = DeviceMover({"actor": model}, [opt], target)
    mover.sleep()
    read = {f"p.{n}": mover.read(p.detach()) for n, p in model.named_parameters()}
    read.update({f"b.{n}": mover.read(b) for n, b in model.named_buffers()})
    for i, p in enumerate(opt.param_groups[0]["params"]):
        read.update({f"s.{i}.{k}": mover.read(v) for k, v in opt.state[p].items()})
    _assert_equal(before, read)
    assert torch.equal(mover.read(view), view_before)
    assert mover.is_asleep
    if kind == "disk":
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    mover.wake_up()
    _assert_equal(before, _values(model, opt))
    mover.sleep()
    stranger = torch.ones(4)
    stranger.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match="not one this mover put to sleep"):
        mover.read(stranger)
    mover.close()
