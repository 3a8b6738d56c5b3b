"""Context-parallel partitioning (megatron's zig-zag split) against hand-written layouts."""

from __future__ import annotations

import pytest
import torch
from miles_megatron.context_parallel import CPSplit


def reference_positions(lengths: list[int], cp: int, rank: int) -> list[int]:
    """Written from the definition: pad each sequence to a multiple of 2*cp, cut it into 2*cp
    equal chunks, rank r takes chunk r then chunk 2*cp-1-r, sequence after sequence."""
    out, start = [], 0
    for n in lengths:
        padded = n + (-n) % (2 * cp)
        size = padded // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            out += list(range(start + c * size, start + (c + 1) * size))
        start += padded
    return out


def test_the_documented_example():
    split = CPSplit.of([8, 4], 2)
    assert split.rank_positions(0).tolist() == [0, 1, 6, 7, 8, 11]
    assert split.rank_positions(1).tolist() == [2, 3, 4, 5, 9, 10]
    assert split.cu_seqlens_padded.tolist() == [0, 8, 12]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_positions_match_the_reference_and_cover_the_row_once(cp):
    lengths = [5, 17, 1, 8, 30]
    split = CPSplit.of(lengths, cp)
    assert split.padded_lengths == [n + (-n) % (2 * cp) for n in lengths]
    every = []
    for rank in range(cp):
        got = split.rank_positions(rank).tolist()
        assert got == reference_positions(lengths, cp, rank)
        assert len(got) == sum(split.padded_lengths) // cp  # balanced
        every += got
    assert sorted(every) == list(range(sum(split.padded_lengths)))


def test_pad_shard_unshard_unpad_round_trip():
    lengths = [5, 3, 9]
    split = CPSplit.of(lengths, 2)
    row = torch.arange(1, sum(lengths) + 1)[None]  # [1, T], 0 marks padding below
    padded = split.pad(row, fill=0)
    assert padded.shape == (1, 8 + 4 + 12)
    assert padded[0, :8].tolist() == [1, 2, 3, 4, 5, 0, 0, 0]
    assert padded[0, 8:12].tolist() == [6, 7, 8, 0]
    shards = [split.shard(padded, r) for r in range(2)]
    assert shards[0][0].tolist() == [1, 2, 0, 0, 6, 0, 9, 10, 11, 0, 0, 0]
    assert torch.equal(split.unshard(shards), padded)
    assert torch.equal(split.unpad(split.unshard(shards)), row)
    # hidden states [T, H] split along dim 0
    hidden = torch.randn(sum(lengths), 3)
    parts = [split.shard(split.pad(hidden, dim=0), r, dim=0) for r in range(2)]
    assert torch.equal(split.unpad(split.unshard(parts, dim=0), dim=0), hidden)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="context-parallel-size"):
        CPSplit.of([4], 0)
    with pytest.raises(ValueError, match="cp_rank 2"):
        CPSplit.of([4], 2).rank_positions(2)
    with pytest.raises(ValueError, match="expected 2 shards"):
        CPSplit.of([4], 2).unshard([torch.zeros(2)])
