"""Deferred tensors (miles_sync.deferred) against plain tensors: the bucket slots let each one
fill its own range of the slot (no tensor of its own), with the same bytes and metadata as the
plain tensors it stands for; ``materialized``, ``fill_source`` and the verify recorder treat
them as those tensors."""

from __future__ import annotations

import pytest
import torch
from miles_core.engine import EngineClient
from miles_sync.bucket_slots import BucketSlots
from miles_sync.buckets import pack_bucket, plan_buckets
from miles_sync.deferred import DeferredTensor, fill_source, materialize, materialized
from miles_sync.readback import SentDigests


def plain():
    torch.manual_seed(0)
    return [
        ("a", torch.randn(3, 5, dtype=torch.bfloat16)),
        ("b", torch.randint(0, 9, (7,), dtype=torch.int8)),
        ("c", torch.randn(4, 4)),
        ("empty", torch.empty(0, 3)),
    ]


def deferring(pairs, fills: list):
    """Each tensor as a deferred one that casts a float64 copy of its values into ``out``
    (recording the storage it was given)."""
    out = []
    for name, tensor in pairs:
        wide = tensor.double()

        def fill(dest, wide=wide, name=name):
            fills.append((name, dest.untyped_storage().data_ptr()))
            dest.copy_(wide)

        out.append((name, DeferredTensor(tensor.shape, tensor.dtype, "cpu", fill)))
    return out


def test_pack_fills_the_slot_in_place_with_the_plain_bytes():
    fills: list = []
    slots = BucketSlots("cpu", capacity=16)
    flat, metadata = slots.pack(0, deferring(plain(), fills))
    want_flat, want_meta = pack_bucket(plain())
    assert torch.equal(flat, want_flat)
    assert [(m.name, m.start_idx, m.end_idx) for m in metadata] == [
        (m.name, m.start_idx, m.end_idx) for m in want_meta
    ]
    slot = flat.untyped_storage().data_ptr()
    assert sorted(n for n, _ in fills) == ["a", "b", "c", "empty"]
    assert {ptr for _, ptr in fills} == {slot}  # every fill wrote into the slot itself
    assert torch.equal(pack_bucket(deferring(plain(), []))[0], want_flat)


def test_planning_reads_shapes_and_dtypes_only():
    fills: list = []
    groups = list(plan_buckets(deferring(plain(), fills), max_bytes=64))
    assert [[n for n, _ in g] for g in groups] == [
        [n for n, _ in g] for g in plan_buckets(plain(), 64)
    ]
    assert fills == []


def test_materialized_and_fill_source():
    fills: list = []
    got = list(materialized(deferring(plain(), fills)))
    for (name, a), (_, b) in zip(plain(), got):
        assert type(b) is torch.Tensor and b.dtype == a.dtype and torch.equal(a, b), name
    tensor = torch.ones(2)
    assert materialize(tensor) is tensor

    class Offers(list):
        def deferred(self):
            return "deferred pairs"

    assert fill_source(Offers()) == "deferred pairs"
    pairs = plain()
    assert fill_source(pairs) is pairs


def test_fill_refuses_another_shape_or_dtype():
    deferred = DeferredTensor((2, 3), torch.float32, "cpu", lambda out: out.fill_(1))
    with pytest.raises(ValueError, match=r"cannot fill a \(3, 2\) torch.float32"):
        deferred.fill(torch.empty(3, 2))
    with pytest.raises(ValueError, match="torch.bfloat16"):
        deferred.fill(torch.empty(2, 3, dtype=torch.bfloat16))


def test_verify_records_a_deferred_tensor_once_it_filled_its_bucket():
    floats = [(n, t) for n, t in plain() if t.is_floating_point()]
    sent, want = SentDigests({None, torch.float32}), SentDigests({None, torch.float32})
    for name, tensor in floats:
        want.record(name, tensor)
    watched = list(sent.watch(deferring(floats, [])))
    assert sent.digests == {}  # nothing filled yet
    BucketSlots("cpu", capacity=16).pack(0, watched)
    assert sent.digests == want.digests and sent.as_sent == want.as_sent
    assert set(sent.specs) == {"a", "c", "empty"}


def test_ipc_push_fills_deferred_tensors_into_its_slots(monkeypatch):
    from miles_sync.ipc import IpcTransport
    from miles_sync.ranks import RankContext

    sent = []
    monkeypatch.setattr(
        EngineClient, "update_weights_from_tensor", lambda self, *a, **k: sent.append(a)
    )
    transport = IpcTransport(RankContext(), buffer_size=64, device=torch.device("cpu"))
    transport.connect([EngineClient("http://engine-0")])
    fills: list = []
    stats = transport.push(iter(deferring(plain(), fills)))
    transport.close()
    assert stats["buckets"] == len(sent) and sorted(n for n, _ in fills) == ["a", "b", "c", "empty"]
