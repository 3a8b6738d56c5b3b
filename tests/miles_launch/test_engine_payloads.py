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
        b"\x8c\x03set\x94\x93\x94"  # 'set' MEMOIZE STACK_GLOBAL MEMOIZE  (allowed: builtins.set)
        b"\x8c\x02os\x85R\x94"  # set(('os',)) (computed) MEMOIZE
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


# ---- only transport handles: no storage built inline, every view inside its storage ----------
def _shared_storage(nbytes: int):
    """A real torch shared-memory segment of ``nbytes`` (kept alive by the returned storage)
    and its ``(manager, handle, size)``."""
    previous = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        storage = torch.zeros(nbytes, dtype=torch.uint8).untyped_storage()
        return storage, storage._share_filename_cpu_()
    finally:
        mp.set_sharing_strategy(previous)


def _tensor_pickle(manager, handle, size, offset, shape, stride, dtype=torch.float32) -> bytes:
    """What ForkingPickler writes for a CPU tensor, with every number chosen by the caller."""
    storage = _Reduce(
        reductions.rebuild_storage_filename, torch.UntypedStorage, manager, handle, size
    )
    typed = _Reduce(reductions.rebuild_typed_storage, storage, dtype)
    meta = (offset, _Reduce(torch.Size, tuple(shape)), tuple(stride), False)
    return pickle.dumps([("w", _Reduce(reductions.rebuild_tensor, torch.Tensor, typed, meta))])


def test_a_view_larger_than_its_storage_is_refused_before_it_is_made():
    """The issue's heap read: a 16-byte segment rebuilt as 4096 floats made torch grow the
    storage with engine heap bytes. Refused, naming the view and the storage's size."""
    keep, (manager, handle, size) = _shared_storage(16)
    ok = decode_serialized(_tensor_pickle(manager, handle, size, 0, (4,), (1,)))
    assert ok[0][1].shape == (4,)  # the same pickle with honest numbers decodes
    for offset, shape, stride in [(0, (4096,), (1,)), (3, (2,), (1,)), (0, (2, 2), (3, 1))]:
        data = _tensor_pickle(manager, handle, size, offset, shape, stride)
        with pytest.raises(UnsafePayloadError, match="reaches past its 16-byte storage"):
            decode_serialized(data)
    with pytest.raises(UnsafePayloadError, match="stride"):
        decode_serialized(_tensor_pickle(manager, handle, size, 0, (2,), (-1,)))
    del keep


def test_a_segment_size_beyond_the_segment_is_refused():
    """Mapping more bytes than the segment holds would extend the sender's segment (torch
    truncates the file up to the size it is asked to map): a payload could make the host's
    shared memory as large as it likes."""
    keep, (manager, handle, _) = _shared_storage(16)
    data = _tensor_pickle(manager, handle, 1 << 40, 0, (4,), (1,))
    with pytest.raises(UnsafePayloadError, match=r"holds \d+ bytes, the payload claims 1099511"):
        decode_serialized(data)
    with pytest.raises(UnsafePayloadError, match="does not exist"):
        decode_serialized(_tensor_pickle(manager, b"/torch_1_2_3", 16, 0, (4,), (1,)))
    del keep


@pytest.mark.parametrize(
    "obj",
    [
        _Reduce(torch.Tensor, [1.0, 2.0, 3.0]),  # fills a new storage with the payload's values
        _Reduce(torch.UntypedStorage, 1 << 10),  # allocates uninitialised memory
        _Reduce(torch.nn.Parameter, _Reduce(torch.Tensor, 4)),
    ],
    ids=["Tensor(list)", "UntypedStorage(n)", "Parameter(Tensor(n))"],
)
def test_constructors_that_build_storage_inline_are_refused(obj):
    data = pickle.dumps([("w", obj)])
    with pytest.raises(UnsafePayloadError, match="not callable|could not be decoded"):
        decode_serialized(data)


def test_reconstructors_and_byte_builders_are_not_on_the_allowlist():
    import copyreg

    for obj, name in [
        (_Reduce(copyreg._reconstructor, torch.Tensor, object, None), "copyreg._reconstructor"),
        (_Reduce(bytearray, 1 << 40), "builtins.bytearray"),
        (_Reduce(torch.device, "cpu"), "torch.device"),
    ]:
        with pytest.raises(UnsafePayloadError, match=f"{name} is not on the allowlist"):
            decode_serialized(pickle.dumps([("w", obj)]))


def test_a_payloads_storages_are_held_to_the_byte_budget():
    named = [("a", torch.zeros(64)), ("b", torch.zeros(64))]  # 256 bytes each
    data = _dump(named)
    assert len(decode_serialized(data, max_bytes=512)) == 2
    with pytest.raises(UnsafePayloadError, match="exceed the 511-byte budget"):
        decode_serialized(data, max_bytes=511)


def test_a_payload_cannot_modify_what_other_payloads_resolve():
    """BUILD on a shared token is refused; a metadata class modified by one payload is that
    payload's own copy."""
    from miles_sync.buckets import FlattenedTensorMetadata

    build_token = b"\x80\x04\x8c\x05torch\x8c\x06Tensor\x93}\x8c\x03cls\x8c\x01x\x73b."
    with pytest.raises(UnsafePayloadError, match="cannot be modified|could not be decoded"):
        decode_serialized(build_token)
    build_class = (
        b"\x80\x04\x8c\x12miles_sync.buckets\x8c\x17FlattenedTensorMetadata\x93"
        b"N}\x8c\x04name\x8c\x01x\x73\x86b."
    )  # BUILD (None, {"name": "x"}) on the class itself: setattr(cls, "name", "x")
    decoded = decode_serialized(build_class)
    assert decoded is not FlattenedTensorMetadata and not hasattr(FlattenedTensorMetadata, "name")


#: The storage class torch's own CUDA reduction names: ``type(tensor._typed_storage())``
#: (torch.multiprocessing.reductions.reduce_tensor), and the untyped one.
TORCH_CUDA_STORAGE_CLASSES = [type(torch.zeros(1)._typed_storage()), torch.UntypedStorage]


@pytest.mark.parametrize("storage_cls", TORCH_CUDA_STORAGE_CLASSES, ids=lambda c: c.__name__)
def test_cuda_handles_are_checked_against_their_storage_before_they_are_opened(
    monkeypatch, storage_cls
):
    def handle(size, stride, offset, storage_bytes, cls=storage_cls):
        return _Reduce(
            reductions.rebuild_cuda_tensor, torch.Tensor, size, stride, offset,
            cls, torch.float32, 0, b"ipc", storage_bytes, 0, False,
            b"ref", 0, b"ev", True,
        )  # fmt: skip

    ok = pickle.dumps([("w", handle((4,), (1,), 0, 16))])
    too_big = pickle.dumps([("w", handle((4096,), (1,), 0, 16))])
    # a class token, but not a storage's
    wrong_class = pickle.dumps([("w", handle((4,), (1,), 0, 16, cls=torch.Tensor))])
    opened = []
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *a: opened.append(a) or "t")
    assert decode_serialized(ok, "cuda") == [("w", "t")]
    assert opened[0][0] is torch.Tensor and opened[0][4] is torch.UntypedStorage
    with pytest.raises(UnsafePayloadError, match="reaches past its 16-byte storage"):
        decode_serialized(too_big, "cuda")
    assert len(opened) == 1
    with pytest.raises(UnsafePayloadError, match="storage class <class torch.Tensor>"):
        decode_serialized(wrong_class, "cuda")
    assert len(opened) == 1


def _bucket_without(field: str) -> str:
    flat, meta = pack_bucket([("a", torch.arange(4)), ("b", torch.randn(3, 2))])
    delattr(meta[1], field)
    return base64.b64encode(_dump({"flattened_tensor": flat, "metadata": meta})).decode()


@pytest.mark.parametrize("field", ["name", "shape", "dtype", "start_idx", "end_idx", "numel"])
def test_bucket_metadata_missing_a_field_is_refused_naming_it(field):
    """The issue's engine kill: a metadata object without a field raised AttributeError."""
    with pytest.raises(
        WeightUpdateError, match=rf"metadata\[1\]: missing field\(s\) \['{field}'\]"
    ):
        decode_tensor_payload([_bucket_without(field)], "flattened_bucket")


def test_bucket_metadata_numel_must_match_its_byte_range():
    with pytest.raises(WeightUpdateError, match=r"metadata\[1\] \('b'\).numel 7 != end_idx"):
        decode_tensor_payload([_bucket_entry(numel=7)], "flattened_bucket")


def test_sglang_named_bucket_metadata_still_decodes():
    from miles_sync.buckets import dumps_sglang_wire, to_sglang_metadata

    flat, meta = pack_bucket([("a", torch.arange(4)), ("b", torch.randn(3, 2))])
    previous = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        data = dumps_sglang_wire({"flattened_tensor": flat, "metadata": to_sglang_metadata(meta)})
    finally:
        mp.set_sharing_strategy(previous)
    entry = base64.b64encode(data).decode()
    assert b"sglang.srt.weight_sync.tensor_bucket" in base64.b64decode(entry)
    out = dict(decode_tensor_payload([entry], "flattened_bucket"))
    assert torch.equal(out["a"], torch.arange(4)) and out["b"].shape == (3, 2)
