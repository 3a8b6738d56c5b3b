"""Dynamic micro-batching under a per-GPU token budget.

A rank's data for one optimizer step is cut into micro-batches whose total token count (prompt +
response, before padding) stays within ``--max-tokens-per-gpu`` x ``--context-parallel-size``
(context parallelism spreads one micro-batch over the CP group). All data-parallel ranks must run
the same number of micro-batches so that their collectives line up: each rank computes the
number it needs (:func:`count_micro_batches`, first-fit decreasing), the ranks agree on the
maximum (:func:`agree_num_micro_batches`, an all-reduce over a gloo group), and each rank then
splits its data into exactly that many (:func:`make_micro_batches`), balancing token counts with
Karmarkar-Karp when the budget allows. A rank with fewer samples than micro-batches gets empty
ones; packing turns those into a block of padding. :func:`split_micro_batches` is the whole
sequence for one rank, in either mode (``--use-dynamic-batch-size`` or ``--micro-batch-size``).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from miles_core.aggregation import all_reduce_host
from miles_core.args.groups import AlgorithmArgs
from miles_core.batch import RolloutBatch
from miles_core.partition import karmarkar_karp


def micro_batch_budget(max_tokens_per_gpu: int, cp_size: int = 1) -> int:
    """Tokens one micro-batch may hold: ``max_tokens_per_gpu * cp_size``."""
    if max_tokens_per_gpu < 1:
        raise ValueError(f"--max-tokens-per-gpu must be >= 1, got {max_tokens_per_gpu}")
    if cp_size < 1:
        raise ValueError(f"--context-parallel-size must be >= 1, got {cp_size}")
    return max_tokens_per_gpu * cp_size


def _check_fits(lengths: Sequence[int], budget: int, source: Sequence[int] | None = None) -> None:
    for i, n in enumerate(lengths):
        if n > budget:
            which = i if source is None else source[i]
            raise ValueError(
                f"sample {which} has {n} tokens, more than one micro-batch holds "
                f"({budget} = --max-tokens-per-gpu x --context-parallel-size)"
            )


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bin packing by first-fit decreasing: indices grouped into bins of sum <= ``capacity``."""
    _check_fits(lengths, capacity)
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= capacity:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def count_micro_batches(batch: RolloutBatch, max_tokens_per_gpu: int, cp_size: int = 1) -> int:
    """How many micro-batches this rank needs for ``batch`` (at least 1)."""
    budget = micro_batch_budget(max_tokens_per_gpu, cp_size)
    _check_fits(batch.total_lengths, budget, batch.source_indices)
    return max(len(first_fit_decreasing(batch.total_lengths, budget)), 1)


def agree_num_micro_batches(local: int, group: dist.ProcessGroup | None = None) -> int:
    """The maximum of ``local`` over ``group`` (a gloo group; the default group when None).

    Without an initialized process group this is ``local``.
    """
    value = torch.tensor([int(local)], dtype=torch.int64)
    return int(all_reduce_host(value, dist.ReduceOp.MAX, group).item())


def make_micro_batches(
    batch: RolloutBatch,
    max_tokens_per_gpu: int,
    cp_size: int = 1,
    num: int | None = None,
) -> list[RolloutBatch]:
    """Split ``batch`` into ``num`` micro-batches (default: :func:`count_micro_batches`), each
    within the token budget, samples in their original order inside each micro-batch.

    Token counts are balanced with Karmarkar-Karp; where that breaks the budget (tight packings),
    the first-fit-decreasing packing is used, completed with empty micro-batches. ``num`` must be
    at least what first-fit decreasing needs.
    """
    budget = micro_batch_budget(max_tokens_per_gpu, cp_size)
    lengths = batch.total_lengths
    _check_fits(lengths, budget, batch.source_indices)
    ffd = first_fit_decreasing(lengths, budget)
    if num is None:
        num = max(len(ffd), 1)
    if num < len(ffd):
        raise ValueError(
            f"{num} micro-batches cannot hold this rank's {len(batch)} samples within "
            f"{budget} tokens each (--max-tokens-per-gpu); {len(ffd)} are needed"
        )
    bins = karmarkar_karp(lengths, num)
    if any(sum(lengths[i] for i in b) > budget for b in bins):
        bins = ffd + [[] for _ in range(num - len(ffd))]
    bins = sorted((sorted(b) for b in bins), key=lambda b: (not b, b[:1]))
    return [batch.select(b) for b in bins]


def fixed_size_micro_batches(
    batch: RolloutBatch, micro_batch_size: int, num: int | None = None
) -> list[RolloutBatch]:
    """Consecutive micro-batches of ``micro_batch_size`` samples (``--micro-batch-size``, when
    ``--use-dynamic-batch-size`` is off); the last may be shorter. ``num`` (the maximum over DP
    ranks) appends empty micro-batches so that every rank runs the same count."""
    if micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be >= 1, got {micro_batch_size}")
    n = len(batch)
    chunks = [
        batch.select(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)
    ]
    need = max(len(chunks), 1)
    if num is None:
        num = need
    if num < need:
        raise ValueError(
            f"{num} micro-batches cannot hold {n} samples at --micro-batch-size {micro_batch_size}"
        )
    return chunks + [batch.select([]) for _ in range(num - len(chunks))]


def rollout_indices(batch: RolloutBatch, group: dist.ProcessGroup | None = None) -> list[int]:
    """The ``source_indices`` of every rank's shard of one rollout together, ascending: the
    rollout's sample order (a collective over ``group`` when torch.distributed is initialized).

    Every rank holding the same batch (data-parallel replicas of one rollout, as some tools and
    tests run them) is that batch: each rank then trains all of every step, as at one rank.
    Raises ``ValueError`` when shards overlap otherwise: they are then not shards of one
    rollout, and no step split would be the same as at one rank.
    """
    local = list(batch.source_indices)
    gathered = [local]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local, group=group)
        if len(set(local)) == len(local) and all(shard == local for shard in gathered):
            return sorted(local)  # replicas
    indices = sorted(i for shard in gathered for i in shard)
    if len(set(indices)) != len(indices):
        raise ValueError(
            "the data-parallel ranks' batches share samples (repeated source_indices): each "
            "rank must get its own shard of the rollout (miles_core.partition.partition_for_dp)"
        )
    return indices


def split_steps(
    batch: RolloutBatch, num_steps: int, group: dist.ProcessGroup | None = None
) -> list[RolloutBatch]:
    """This rank's part of each of the rollout's ``num_steps`` optimizer steps
    (``--num-steps-per-rollout``; a collective over the data-parallel ``group``).

    The steps are cut from the whole rollout, not from this rank's shard: with ``N`` samples in
    all (every shard of ``group`` together, in ``source_indices`` order, see
    :func:`rollout_indices`), step ``k`` holds the samples at positions ``N*k//num_steps`` to
    ``N*(k+1)//num_steps`` (sizes differing by at most one sample). Each step therefore trains
    the same samples at any data-parallel size and partition; this rank's part of a step (its
    samples in shard order) may be empty.
    """
    if num_steps < 1:
        raise ValueError(f"--num-steps-per-rollout must be >= 1, got {num_steps}")
    indices = rollout_indices(batch, group)
    n = len(indices)
    position = {src: p for p, src in enumerate(indices)}
    bounds = [n * k // num_steps for k in range(num_steps + 1)]
    members: list[list[int]] = [[] for _ in range(num_steps)]
    for i, src in enumerate(batch.source_indices):
        members[bisect.bisect_right(bounds, position[src]) - 1].append(i)
    return [batch.select(m) for m in members]


@dataclass(frozen=True)
class MicroBatching:
    """How a rank cuts its data into micro-batches: by token budget (``dynamic``,
    ``--use-dynamic-batch-size`` with ``--max-tokens-per-gpu`` x ``cp_size``) or by
    ``--micro-batch-size`` samples."""

    dynamic: bool
    max_tokens_per_gpu: int | None
    micro_batch_size: int
    cp_size: int = 1

    @classmethod
    def from_algorithm(cls, algorithm: AlgorithmArgs, cp_size: int = 1) -> MicroBatching:
        """The micro-batching of the parsed algorithm group (``args.run_config.algorithm``)."""
        return cls(
            dynamic=bool(algorithm.use_dynamic_batch_size),
            max_tokens_per_gpu=algorithm.max_tokens_per_gpu,
            micro_batch_size=algorithm.micro_batch_size,
            cp_size=cp_size,
        )


def split_micro_batches(
    batch: RolloutBatch, how: MicroBatching, group: dist.ProcessGroup | None = None
) -> list[RolloutBatch]:
    """This rank's micro-batches of ``batch``, as many as the busiest rank of ``group`` needs.

    Each rank counts what it needs (first-fit decreasing under the token budget, or
    ``ceil(len / micro_batch_size)``, at least 1), the ranks agree on the maximum
    (:func:`agree_num_micro_batches`, a collective: every rank of ``group`` calls this together),
    and the batch is split into exactly that many; ranks that need fewer get empty ones.
    """
    if how.dynamic:
        if how.max_tokens_per_gpu is None:
            raise ValueError("--use-dynamic-batch-size needs --max-tokens-per-gpu")
        local = count_micro_batches(batch, how.max_tokens_per_gpu, how.cp_size)
        num = agree_num_micro_batches(local, group=group)
        return make_micro_batches(batch, how.max_tokens_per_gpu, how.cp_size, num=num)
    if how.micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be >= 1, got {how.micro_batch_size}")
    local = max(-(-len(batch) // how.micro_batch_size), 1)
    num = agree_num_micro_batches(local, group=group)
    return fixed_size_micro_batches(batch, how.micro_batch_size, num=num)
