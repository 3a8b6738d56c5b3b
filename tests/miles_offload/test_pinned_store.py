"""Wake's device layout helpers (plan_segments, coalesce_copies): arithmetic checked by hand."""

from miles_offload.pinned_store import coalesce_copies, plan_segments

MiB = 1 << 20


def test_small_pool_tensors_are_left_out_and_sizes_round_to_512():
    # 1 MiB and less: the allocator's small pool; 3 MiB + 1 byte rounds up to the next 512.
    plan = plan_segments([MiB, 100, 3 * MiB + 1, 4 * MiB], segment_bytes=1 << 30)
    assert plan == {2: 3 * MiB + 512 + 4 * MiB}


def test_segments_close_before_they_would_exceed_the_limit():
    sizes = [4 * MiB] * 5 + [2 * MiB] + [4 * MiB] * 3
    plan = plan_segments(sizes, segment_bytes=10 * MiB)
    assert plan == {0: 8 * MiB, 2: 8 * MiB, 4: 10 * MiB, 7: 8 * MiB}  # 10 MiB fits exactly
    assert sum(plan.values()) == sum(sizes)


def test_a_tensor_larger_than_a_segment_gets_its_own():
    plan = plan_segments([2 * MiB, 64 * MiB, 2 * MiB], segment_bytes=16 * MiB)
    assert plan == {0: 2 * MiB, 1: 64 * MiB, 2: 2 * MiB}


def test_nothing_to_reserve():
    assert plan_segments([], 1 << 30) == {}
    assert plan_segments([0, 512, MiB], 1 << 30) == {}


def test_copies_following_on_at_the_same_distance_merge():
    # two tensors of 1000 and 24 bytes in 512-byte slots, then one that follows at a different
    # distance on the device side, then one 600 bytes further (too far to be padding)
    dst = [0, 1024, 1536, 1536 + 512 + 600 + 512]
    src = [10_000, 11_024, 11_536 + 64, 11_536 + 64 + 512 + 600 + 512]
    size = [1000, 24, 100, 8]
    merged = coalesce_copies(dst, src, size)
    assert merged == ([0, 1536, 2648 + 512], [10_000, 11_600, 13_224], [1048, 100, 8])


def test_merged_copies_move_the_same_tensor_bytes():
    """The merged list, applied to byte arrays, leaves every tensor's bytes where the per-tensor
    list puts them (the gaps carry padding only)."""
    import random

    rng = random.Random(0)
    sizes = [rng.choice([7, 512, 1000, 4096, 3]) for _ in range(40)]
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end = (end + n + 511) // 512 * 512
    source = bytes(rng.randrange(256) for _ in range(end))

    def apply(dst, src, size):
        out = bytearray(end)
        for d, s, n in zip(dst, src, size):
            out[d : d + n] = source[s : s + n]
        return out

    per_tensor = apply(offsets, offsets, sizes)
    merged = coalesce_copies(offsets, offsets, sizes)
    assert len(merged[0]) == 1  # one copy for the whole run
    coalesced = apply(*merged)
    for off, n in zip(offsets, sizes):
        assert coalesced[off : off + n] == per_tensor[off : off + n]
