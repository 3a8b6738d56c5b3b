"""Wake's device layout helpers (plan_segments): arithmetic checked by hand."""

from miles_offload.pinned_store import plan_segments

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
