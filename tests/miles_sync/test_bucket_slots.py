"""Double-buffered bucket packing against the codec's own pack_bucket."""

from __future__ import annotations

import torch
from miles_sync.bucket_slots import BucketSlots
from miles_sync.buckets import pack_bucket, plan_buckets, unpack_bucket


def named():
    torch.manual_seed(0)
    return [
        ("a", torch.randn(3, 5, dtype=torch.bfloat16)),
        ("b", torch.randint(0, 9, (7,), dtype=torch.int8)),
        ("c", torch.randn(4, 4)),  # fp32 after an odd-length bf16 one: ordered ahead of it
        ("d", torch.randn(2, dtype=torch.float64)),
        ("empty", torch.empty(0, 3)),
    ]


def test_pack_equals_pack_bucket_bytes_and_metadata():
    slots = BucketSlots("cpu", capacity=16)
    flat, metadata = slots.pack(0, named())
    want_flat, want_meta = pack_bucket(named())
    assert torch.equal(flat, want_flat)
    assert [(m.name, m.start_idx, m.end_idx, m.dtype) for m in metadata] == [
        (m.name, m.start_idx, m.end_idx, m.dtype) for m in want_meta
    ]
    unpacked = dict(unpack_bucket(flat, metadata))
    for name, want in named():
        got = unpacked[name]
        assert got.dtype == want.dtype and torch.equal(got, want), name


def test_slots_alternate_and_grow():
    slots = BucketSlots("cpu", capacity=64, shared=True)
    assert slots.held_bytes == 0
    first, _ = slots.pack(0, [("x", torch.ones(4))])
    assert slots.held_bytes == 16  # the bucket's size, not the capacity: it is shared whole
    assert first.untyped_storage().nbytes() == 16
    second, _ = slots.pack(1, [("y", torch.ones(4))])
    third, _ = slots.pack(2, [("z", torch.full((4,), 2.0))])
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    assert first.untyped_storage().data_ptr() == third.untyped_storage().data_ptr()
    assert third.is_shared()
    big, meta = slots.pack(3, [("big", torch.arange(100.0))])  # 400 bytes > 64: grows
    assert big.numel() == 400 and torch.equal(unpack_bucket(big, meta)[0][1], torch.arange(100.0))
    assert slots.held_bytes == 16 + 400  # slot 1 grew; slot 0 kept its size


def test_slots_are_dense_in_aligned_order():
    """No padding: an int8 tensor then an fp32 one are packed fp32 first, back to back."""
    slots = BucketSlots("cpu", capacity=64)
    slots.pack(0, [("x", torch.full((16,), 255, dtype=torch.uint8))])
    flat, meta = slots.pack(2, [("b", torch.ones(1, dtype=torch.int8)), ("f", torch.ones(1))])
    assert [(m.name, m.start_idx, m.end_idx) for m in meta] == [("f", 0, 4), ("b", 4, 5)]
    assert flat.numel() == 5


def test_plan_keeps_buckets_under_the_size_and_big_tensors_alone():
    tensors = [(f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate([10, 30, 100, 5])]
    groups = [[name for name, _ in g] for g in plan_buckets(tensors, 40)]
    assert groups == [["t0", "t1"], ["t2"], ["t3"]]
