"""miles_native: arena, copy engine and file streamer against independent references
(Python file reads, torch copies). CPU mode: the copy engine is memcpy."""

from __future__ import annotations

import errno
import os

import miles_native as mn
import pytest
import torch


def test_build_reports_cuda_state():
    assert "miles_native" in mn.build_info()
    assert isinstance(mn.built_with_cuda(), bool)
    assert mn.cuda_runtime_available() == torch.cuda.is_available() or not mn.built_with_cuda()


def test_arena_is_page_aligned_writable_buffer():
    arena = mn.PinnedArena(10_000)
    assert arena.ptr % os.sysconf("SC_PAGE_SIZE") == 0
    assert arena.nbytes % os.sysconf("SC_PAGE_SIZE") == 0 and arena.nbytes >= 10_000
    view = torch.frombuffer(arena, dtype=torch.uint8)
    assert view.data_ptr() == arena.ptr and view.numel() == arena.nbytes
    view[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert bytes(memoryview(arena)[:4]) == b"\x01\x02\x03\x04"
    assert arena.pinned == mn.cuda_runtime_available()


def test_copy_engine_copies_batches_and_splits_large_copies():
    engine = mn.CopyEngine(cpu_threads=2, split_bytes=4096)
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(n, generator=g) for n in (0, 1, 1000, 50_000)]
    dsts = [torch.zeros_like(s) for s in srcs]
    ticket = engine.submit(
        [d.data_ptr() for d in dsts],
        [s.data_ptr() for s in srcs],
        [s.numel() * 4 for s in srcs],
        to_device=True,
    )
    ticket.wait()
    engine.synchronize()
    for s, d in zip(srcs, dsts):
        assert torch.equal(s, d)
    with pytest.raises(ValueError, match="same length"):
        engine.submit([1], [], [], to_device=False)


def _regions(g):
    """Three tensors at file offsets that cross 8 KiB chunk boundaries, with gaps."""
    tensors = [
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (5000, 20000, 3)
    ]
    offsets = [100, 9000, 40000]
    return tensors, offsets


@pytest.mark.parametrize("direct", [True, False])
def test_store_load_round_trip_matches_file_bytes(tmp_path, direct):
    g = torch.Generator().manual_seed(1)
    tensors, offsets = _regions(g)
    engine = mn.CopyEngine()
    path = str(tmp_path / "f.bin")
    s = mn.open_file_streamer(path, chunk_bytes=8192, ring_chunks=2, io_threads=2, direct=direct)
    assert s.direct == direct and s.ring_bytes == 2 * 8192
    end = s.store([t.data_ptr() for t in tensors], offsets, [t.numel() for t in tensors], engine)
    assert end == 40960  # 40003 rounded up to 4 KiB
    raw = open(path, "rb").read()
    assert len(raw) == end
    for t, off in zip(tensors, offsets):
        assert raw[off : off + t.numel()] == bytes(t.tolist())
    back = [torch.zeros_like(t) for t in tensors]
    s.load([b.data_ptr() for b in back], offsets, [t.numel() for t in tensors], engine)
    for t, b in zip(tensors, back):
        assert torch.equal(t, b)
    # overwritten in place: a second store with new values changes the bytes, not the size
    tensors[1].add_(1)
    s.store([t.data_ptr() for t in tensors], offsets, [t.numel() for t in tensors], engine)
    raw = open(path, "rb").read()
    assert len(raw) == end and raw[9000 : 9000 + 20000] == bytes(tensors[1].tolist())
    s.close(remove=True)
    assert not os.path.exists(path)


def test_raw_direct_io_round_trip_and_misalignment(tmp_path):
    path = str(tmp_path / "raw.bin")
    s = mn.open_file_streamer(path, chunk_bytes=8192, io_threads=3)
    if not s.direct:
        pytest.skip("this filesystem refuses O_DIRECT")
    arena = mn.PinnedArena(6 * 4096)
    buf = torch.frombuffer(arena, dtype=torch.uint8)
    buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8))
    s.write(arena.ptr, 6 * 4096, 4096)
    assert open(path, "rb").read()[4096:] == bytes(buf.tolist())
    other = mn.PinnedArena(6 * 4096)
    s.read(other.ptr, 6 * 4096, 4096)
    assert bytes(memoryview(other)) == bytes(memoryview(arena))
    with pytest.raises(OSError) as info:
        s.write(arena.ptr + 8, 4096, 0)
    assert info.value.errno == errno.EINVAL and info.value.filename == path
    assert "offset 0" in str(info.value) and "4096" in str(info.value)


def test_read_past_end_names_path_and_offset(tmp_path):
    path = str(tmp_path / "short.bin")
    with open(path, "wb") as f:
        f.write(b"x" * 4096)
    s = mn.open_file_streamer(path, chunk_bytes=4096, direct=False)
    out = torch.zeros(8192, dtype=torch.uint8)
    with pytest.raises(OSError) as info:
        s.read(out.data_ptr(), 8192, 0)
    assert info.value.errno == errno.EIO and info.value.filename == path
    assert info.value.offset == 4096 and "unexpected end of file" in str(info.value)


def test_enospc_is_an_oserror_with_offset():
    t = torch.ones(100_000, dtype=torch.uint8)
    s = mn.open_file_streamer("/dev/full", chunk_bytes=16384, ring_chunks=2)
    with pytest.raises(OSError) as info:
        s.store([t.data_ptr()], [0], [t.numel()], mn.CopyEngine())
    assert info.value.errno == errno.ENOSPC and info.value.filename == "/dev/full"
    assert "at offset" in str(info.value)
    s.close()


def test_overlapping_regions_and_closed_streamer_are_errors(tmp_path):
    t = torch.zeros(100, dtype=torch.uint8)
    s = mn.open_file_streamer(str(tmp_path / "o.bin"), chunk_bytes=4096)
    with pytest.raises(ValueError, match="overlap"):
        s.store([t.data_ptr(), t.data_ptr()], [0, 50], [100, 100], mn.CopyEngine())
    s.close()
    with pytest.raises(OSError) as info:
        s.write(t.data_ptr(), 4096, 0)
    assert info.value.errno == errno.EBADF
