"""The flattened bucket codec: bit-exact round trips, the dense layout SGLang rebuilds, the
planner's bound, and pickling under SGLang's class path."""

import io
import pickle
import pickletools

import pytest
import torch
from miles_sync.buckets import (
    FlattenedTensorMetadata,
    bucket_layout,
    dumps_sglang_wire,
    pack_bucket,
    plan_buckets,
    plan_buckets_marked,
    tensor_nbytes,
    to_sglang_metadata,
    unpack_bucket,
)


class _SGLangNamesUnpickler(pickle.Unpickler):
    """Stands in for SGLang's receiver: its dataclass has the same six fields."""

    def find_class(self, module, name):
        if (module, name) == ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"):
            return FlattenedTensorMetadata
        return super().find_class(module, name)


def _mixed():
    g = torch.Generator().manual_seed(0)
    return [
        ("a.int8", torch.randint(-128, 127, (3,), dtype=torch.int8, generator=g)),
        ("b.f32", torch.randn(2, generator=g)),
        ("c.bf16", torch.randn(3, generator=g).to(torch.bfloat16)),
        ("d.i64", torch.randint(0, 1 << 40, (1,), generator=g)),
        ("e.bool", torch.tensor([True, False, True])),
        ("f.f16", torch.randn(2, 2, generator=g).half()),
        ("g.empty", torch.empty(0, 4)),
        ("h.f64", torch.randn(2, 3, generator=g, dtype=torch.float64).t()),  # non-contiguous
    ]


def test_round_trip_mixed_dtypes_bit_exact():
    named = _mixed()
    flat, meta = pack_bucket(named)
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    out = dict(unpack_bucket(flat, meta))
    assert sorted(out) == sorted(n for n, _ in named)
    for name, want in named:
        got = out[name]
        assert got.dtype == want.dtype and got.shape == want.shape
        # bit-exact: compare the raw bytes, not values (NaN-safe, -0.0-safe)
        assert bytes(got.contiguous().view(-1).view(torch.uint8).numpy()) == bytes(
            want.contiguous().view(-1).view(torch.uint8).numpy()
        )


def test_layout_is_dense_and_aligned_by_ordering():
    named = [
        ("x", torch.ones(3, dtype=torch.int8)),
        ("y", torch.ones(2, dtype=torch.float32)),
        ("z", torch.ones(1, dtype=torch.bfloat16)),
        ("w", torch.ones(1, dtype=torch.int64)),
    ]
    flat, meta = pack_bucket(named)
    # by hand: largest item size first, no gaps: int64 [0,8); f32 [8,16); bf16 [16,18); int8 [18,21)
    assert [(m.name, m.start_idx, m.end_idx, m.numel) for m in meta] == [
        ("w", 0, 8, 8),
        ("y", 8, 16, 8),
        ("z", 16, 18, 2),
        ("x", 18, 21, 3),
    ]
    assert flat.numel() == 21


def _receiver_layout(names, dtypes, shapes):
    """What a receiver that knows only names, dtypes and shapes computes (SGLang's
    ``FlattenedTensorBucket.empty``, written out by hand): each tensor where the previous one
    ended; an offset that is not a multiple of the dtype's item size is refused."""
    offsets, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        assert offset % dtype.itemsize == 0, f"Unaligned received tensor {name}"
        size = torch.Size(shape).numel() * dtype.itemsize
        offsets.append((offset, offset + size))
        offset += size
    return offsets, offset


def test_receiver_rebuilds_the_senders_layout_from_names_dtypes_shapes():
    """An odd-length bf16 tensor followed by fp32, int64 and fp16 ones (the issue's case): the
    bucket holds no byte a receiver cannot know about."""
    g = torch.Generator().manual_seed(3)
    named = [
        ("odd.bf16", torch.randn(3, generator=g).to(torch.bfloat16)),
        ("w.f32", torch.randn(5, generator=g)),
        ("i.i64", torch.randint(0, 1 << 40, (3,), generator=g)),
        ("h.f16", torch.randn(7, generator=g).half()),
    ]
    flat, meta = pack_bucket(named)
    offsets, total = _receiver_layout(
        [m.name for m in meta], [m.dtype for m in meta], [m.shape for m in meta]
    )
    assert offsets == [(m.start_idx, m.end_idx) for m in meta] and total == flat.numel()
    back = dict(unpack_bucket(flat, meta))
    for name, tensor in named:
        assert torch.equal(back[name], tensor), name


def test_layout_refuses_an_unaligned_order():
    with pytest.raises(ValueError, match="'b'.*not aligned"):
        bucket_layout([("a", (3,), torch.bfloat16), ("b", (2,), torch.float32)])


def test_unpack_rejects_bad_metadata():
    flat, meta = pack_bucket([("x", torch.ones(2)), ("y", torch.ones(2))])
    bad = FlattenedTensorMetadata("y", torch.Size([3]), torch.float32, 8, 20, 12)
    with pytest.raises(ValueError, match="'y'"):
        unpack_bucket(flat, [meta[0], bad])
    unaligned = FlattenedTensorMetadata("x", torch.Size([1]), torch.float32, 2, 6, 4)
    with pytest.raises(ValueError, match="not aligned"):
        unpack_bucket(flat, [unaligned])


def _packed_size(group):
    return pack_bucket(group)[0].numel()


def test_planner_bound_order_and_oversize_alone():
    g = torch.Generator().manual_seed(1)
    sizes = [5, 17, 3, 64, 1, 1, 30, 8, 100, 2, 7]
    dtypes = [torch.int8, torch.float32, torch.bfloat16, torch.int64]
    named = [(f"t{i}", torch.randn(n, generator=g).to(dtypes[i % 4])) for i, n in enumerate(sizes)]
    bound = 128
    groups = list(plan_buckets(iter(named), bound))
    assert [n for grp in groups for n, _ in grp] == [n for n, _ in named]
    for grp in groups:
        if len(grp) > 1:
            assert _packed_size(grp) <= bound
        else:
            assert _packed_size(grp) <= bound or tensor_nbytes(grp[0][1]) > bound
    oversize = [grp for grp in groups if _packed_size(grp) > bound]
    assert oversize and all(
        len(grp) == 1 for grp in oversize
    )  # t3 (64 x int64) and t8 travel alone
    # maximality: the planner closes a group only when the next tensor would not fit
    for grp, nxt in zip(groups, groups[1:]):
        assert _packed_size(grp + nxt[:1]) > bound


def test_planner_rejects_nonpositive_bound():
    with pytest.raises(ValueError, match="max_bytes"):
        list(plan_buckets([("a", torch.ones(1))], 0))


def test_sglang_class_path_pickles_and_reconstructs():
    flat, meta = pack_bucket([("a", torch.arange(3, dtype=torch.int16)), ("b", torch.ones(2))])
    wire = to_sglang_metadata(meta)
    data = dumps_sglang_wire({"flattened_tensor": flat, "metadata": wire})
    globals_named = set()
    strings, memo, last = [], [], None  # string pushes, memo slots, the last pushed string
    for op, arg, _ in pickletools.genops(io.BytesIO(data)):
        if "UNICODE" in op.name:
            strings.append(arg)
            last = arg
        elif op.name == "MEMOIZE":
            memo.append(last)
        elif op.name in ("BINGET", "LONG_BINGET"):
            last = memo[arg]
            if last is not None:
                strings.append(last)
        elif op.name == "STACK_GLOBAL":
            globals_named.add((strings[-2], strings[-1]))
            last = None
        else:
            last = None
    assert ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata") in globals_named
    assert not any(mod.startswith("miles_sync") for mod, _ in globals_named)
    # what SGLang does on receipt: slice, view as dtype, reshape
    back = _SGLangNamesUnpickler(io.BytesIO(data)).load()
    sent = {"a": torch.arange(3, dtype=torch.int16), "b": torch.ones(2)}
    assert [m.name for m in back["metadata"]] == ["b", "a"]  # aligned order
    for m in back["metadata"]:
        got = back["flattened_tensor"][m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)
        assert torch.equal(got, sent[m.name])


def test_wire_pickling_leaves_no_stand_in_modules():
    """Without sglang installed, SGLang's module path resolves only while a payload is pickled."""
    import importlib.util
    import sys

    flat, meta = pack_bucket([("a", torch.ones(2))])
    dumps_sglang_wire({"flattened_tensor": flat, "metadata": to_sglang_metadata(meta)})
    if importlib.util.find_spec("sglang") is None:
        assert not [name for name in sys.modules if name.split(".")[0] == "sglang"]


@pytest.mark.parametrize("sizes", [[4, 4, 4], [8, 8], [3, 9, 2, 8], [16], [2, 2, 2, 2, 8]])
def test_marked_planner_marks_only_the_last_group_reading_one_tensor_ahead(sizes):
    """Same groups as plan_buckets (bound 8 bytes of int8); only the last is marked; when a
    group is handed out, the stream was read at most one tensor past it."""
    named = [(f"t{i}", torch.zeros(n, dtype=torch.int8)) for i, n in enumerate(sizes)]
    consumed = []

    def stream():
        for item in named:
            consumed.append(item[0])
            yield item

    expected = [[n for n, _ in g] for g in plan_buckets(named, 8)]
    got, marks = [], []
    for group, last in plan_buckets_marked(stream(), 8):
        names = [n for n, _ in group]
        got.append(names)
        marks.append(last)
        assert len(consumed) <= named.index(group[-1]) + 2  # at most one tensor ahead
    assert got == expected
    assert marks == [False] * (len(got) - 1) + [True]
