"""The payload contract of /update_weights_from_tensor, in-process: only what a transfer
needs is admitted (torch's shared-memory files on a CPU engine, CUDA IPC handles on a CUDA
one), nothing that passes fds or names arbitrary files; refusals name the global before any
object is built; malformed bucket metadata is a WeightUpdateError naming the field."""

from __future__ import annotations

import base64
import io
import os
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing as mp
from miles_launch.builtin_engine import safe_unpickle
from miles_launch.builtin_engine.safe_unpickle import (
    UnsafePayloadError,
    decode_serialized,
    scan_globals,
)
from miles_launch.builtin_engine.weight_checks import WeightUpdateError
from miles_launch.builtin_engine.weights import decode_tensor_payload
from miles_sync.buckets import pack_bucket
from torch.multiprocessing import reductions


def _dump(obj, strategy: str = "file_system") -> bytes:
    previous = mp.get_sharing_strategy()
    mp.set_sharing_strategy(strategy)
    try:
        buf = io.BytesIO()
        ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
        return buf.getvalue()
    finally:
        mp.set_sharing_strategy(previous)


class _Reduce:
    """Pickles as ``fn(*args)``: how a hostile payload names any callable it likes."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def test_fd_passing_payload_is_refused_naming_dupfd():
    """torch's file_descriptor strategy (the Linux default) passes an fd: refused."""
    tensor = torch.randn(4)
    data = _dump([("w", tensor)], strategy="file_descriptor")
    with pytest.raises(UnsafePayloadError, match="rebuild_storage_fd is not on the allowlist"):
        decode_serialized(data)


def test_dupfd_of_an_engine_fd_is_refused_before_anything_is_built(monkeypatch):
    """The attack of the issue: DupFd(n) inside the engine, rebuilt as a storage. The refusal
    comes from the opcode scan: the unpickler never runs."""
    from multiprocessing.resource_sharer import DupFd

    def unpickler_ran(self):
        raise AssertionError("the unpickler ran on a refused payload")

    monkeypatch.setattr(safe_unpickle.AllowlistUnpickler, "load", unpickler_ran)
    payload = [
        ("ok", torch.zeros(2)),  # an allowed object first
        ("w", _Reduce(reductions.rebuild_storage_fd, torch.UntypedStorage, _Reduce(DupFd, 0), 8)),
    ]
    data = _dump(payload)
    with pytest.raises(UnsafePayloadError, match="rebuild_storage_fd|DupFd") as info:
        decode_serialized(data)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "manager,handle,word",
    [
        (b"", b"/etc_passwd", "not one torch creates"),
        (b"", b"../../etc/passwd", "not one torch creates"),
        (b"", b"/psm_1234", "not one torch creates"),
        (b"/run/user/0/bus", b"/torch_1_2_3", "manager"),
        (b"/tmp/../x/torch-shm-dir-ab12cd/manager.sock", b"/torch_1_2_3", "manager"),
    ],
)
def test_shared_memory_file_names_are_restricted_to_torchs_own(manager, handle, word):
    storage = _Reduce(
        reductions.rebuild_storage_filename, torch.UntypedStorage, manager, handle, 16
    )
    data = pickle.dumps([("w", storage)])
    with pytest.raises(UnsafePayloadError, match=word):
        decode_serialized(data)


def test_cuda_ipc_handles_are_refused_on_a_cpu_engine():
    data = pickle.dumps([("w", _Reduce(reductions.rebuild_cuda_tensor, torch.Tensor))])
    with pytest.raises(UnsafePayloadError, match="rebuild_cuda_tensor is not on the allowlist"):
        decode_serialized(data, "cpu")
    # a CUDA engine admits the global (the handle itself is the GPU test's business)
    scan_globals(data, safe_unpickle.allowed_globals("cuda"))
    with pytest.raises(UnsafePayloadError, match="rebuild_storage_filename"):
        scan_globals(_dump(torch.zeros(1)), safe_unpickle.allowed_globals("cuda"))


def test_torch_shared_memory_payloads_still_decode():
    named = [("a", torch.randn(3, 2)), ("b", torch.arange(4)), ("c", torch.ones(2).bfloat16())]
    named.append(("p", torch.nn.Parameter(torch.randn(2))))
    named.append(("e", torch.empty(0)))
    out = decode_tensor_payload([base64.b64encode(_dump(named)).decode()], None)
    assert [n for n, _ in out] == [n for n, _ in named]
    assert all(torch.equal(t, w) for (_, t), (_, w) in zip(out, named))


def test_computed_and_extension_globals_are_refused():
    # STACK_GLOBAL whose operands are not pushed strings (here: built by a reduce)
    crafted = (
        b"\x80\x04"  # PROTO 4
        b"\x8c\x08builtins\x94"  # 'builtins' MEMOIZE
        b"\x8c\x03str\x94\x93\x94"  # 'str' MEMOIZE STACK_GLOBAL MEMOIZE  (allowed: builtins.str)
        b"\x8c\x02os\x85R\x94"  # str(('os',)) -> 'os' (computed) MEMOIZE
        b"\x8c\x06system\x94\x93"  # 'system' STACK_GLOBAL  -> computed module: refused
        b"."
    )
    with pytest.raises(UnsafePayloadError, match="computed"):
        decode_serialized(crafted)
    with pytest.raises(UnsafePayloadError, match="EXT1"):
        decode_serialized(b"\x80\x02\x82\x01.")


def test_non_string_entry_is_refused():
    with pytest.raises(UnsafePayloadError, match="base64 string"):
        decode_serialized(12)


def _bucket_entry(**change) -> str:
    # int64 before float32: a bucket is laid out by item size, largest first (SGLang's order)
    flat, meta = pack_bucket([("a", torch.arange(4)), ("b", torch.randn(3, 2))])
    assert [m.name for m in meta] == ["a", "b"]
    for key, value in change.items():
        setattr(meta[1], key, value)
    return base64.b64encode(_dump({"flattened_tensor": flat, "metadata": meta})).decode()


@pytest.mark.parametrize(
    "change,word",
    [
        (dict(start_idx="24"), r"metadata\[1\] \('b'\).start_idx must be an int"),
        (dict(end_idx=10**9), r"metadata\[1\] \('b'\): bytes"),
        (dict(shape=[-1]), r"metadata\[1\] \('b'\).shape"),
        (dict(dtype="int64"), r"metadata\[1\] \('b'\).dtype"),
        (dict(name=7), r"metadata\[1\].name must be a string"),
    ],
)
def test_malformed_bucket_metadata_names_the_field(change, word):
    with pytest.raises(WeightUpdateError, match=word):
        decode_tensor_payload([_bucket_entry(**change)], "flattened_bucket")


def test_bucket_metadata_must_be_metadata_objects():
    flat = torch.zeros(8, dtype=torch.uint8)
    entry = base64.b64encode(_dump({"flattened_tensor": flat, "metadata": [("a", 1)]})).decode()
    with pytest.raises(WeightUpdateError, match=r"metadata\[0\] is a tuple"):
        decode_tensor_payload([entry], "flattened_bucket")
    with pytest.raises(WeightUpdateError, match="load_format"):
        decode_tensor_payload([entry], "bogus")


def test_the_refusal_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    data = pickle.dumps([("x", _Reduce(os.system, f"touch {marker}"))])
    with pytest.raises(UnsafePayloadError, match="posix.system|os.system"):
        decode_serialized(data)
    assert not marker.exists()
