"""tests/full_tensors.full: the blocking gather the multi-rank tests read shards out with."""

from __future__ import annotations

from rank_programs import uneven_gather_program
from spawn import run_ranks


def test_full_gathers_uneven_dim0_shards_two_ranks():
    run_ranks(2, uneven_gather_program)
