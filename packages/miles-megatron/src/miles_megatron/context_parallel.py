"""Context-parallel data partitioning of a THD-packed row: megatron's zig-zag split.

With causal attention the end of a sequence costs more than its start, so megatron splits every
sequence into ``2 * cp`` equal chunks and gives CP rank ``r`` chunks ``r`` and ``2 * cp - 1 - r``
(``megatron.core.utils.get_batch_on_this_cp_rank`` for one sequence; TransformerEngine's
``thd_get_partitioned_indices`` for packed ones). For a packed row each sequence is first padded
to a multiple of ``2 * cp`` (the padded ``cu_seqlens`` go to TE as ``cu_seqlens_q_padded``), then
split on its own; rank ``r``'s local row is, sequence after sequence, its two chunks.

Example, lengths ``(8, 4)`` at ``cp = 2`` (chunks of 2, then of 1)::

    rank 0: [0, 1, 6, 7, 8, 11]      rank 1: [2, 3, 4, 5, 9, 10]

:class:`CPSplit` holds the layout of one packed row: :meth:`~CPSplit.pad` places the unpadded
row (sequences back to back, as miles-core's ``pack_thd`` lays them out) into the padded one,
:meth:`~CPSplit.shard` cuts a rank's part, :meth:`~CPSplit.unshard` reassembles the padded row
from every rank's part (e.g. all-gathered log-probs) and :meth:`~CPSplit.unpad` drops the
padding again. Running attention over the shards needs TransformerEngine's context-parallel
attention (``--context-parallel-size > 1`` is refused without it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CPSplit:
    """The zig-zag layout of sequences of ``lengths`` over ``cp_size`` context-parallel ranks."""

    lengths: tuple[int, ...]
    cp_size: int

    def __post_init__(self) -> None:
        if self.cp_size < 1:
            raise ValueError(f"--context-parallel-size must be >= 1, got {self.cp_size}")
        if any(n < 1 for n in self.lengths):
            raise ValueError(f"sequence lengths must be >= 1, got {self.lengths}")

    @classmethod
    def of(cls, lengths: Sequence[int], cp_size: int) -> CPSplit:
        return cls(tuple(int(n) for n in lengths), int(cp_size))

    @property
    def padded_lengths(self) -> list[int]:
        """Each length rounded up to a multiple of ``2 * cp_size``."""
        unit = 2 * self.cp_size
        return [-(-n // unit) * unit for n in self.lengths]

    @property
    def cu_seqlens_padded(self) -> torch.Tensor:
        """int32 ``[num_sequences + 1]`` offsets of the padded sequences."""
        out = torch.zeros(len(self.lengths) + 1, dtype=torch.int32)
        out[1:] = torch.tensor(self.padded_lengths, dtype=torch.int32).cumsum(0)
        return out

    def padded_positions(self) -> torch.Tensor:
        """For each position of the unpadded row, its position in the padded row."""
        starts = self.cu_seqlens_padded[:-1].tolist()
        return torch.cat(
            [torch.arange(n) + s for n, s in zip(self.lengths, starts, strict=True)]
        ).long()

    def rank_positions(self, cp_rank: int) -> torch.Tensor:
        """Positions of the padded row that CP rank ``cp_rank`` holds, in its local order."""
        if not 0 <= cp_rank < self.cp_size:
            raise ValueError(f"cp_rank {cp_rank} outside [0, {self.cp_size})")
        parts = []
        for start, padded in zip(
            self.cu_seqlens_padded[:-1].tolist(), self.padded_lengths, strict=True
        ):
            chunk = padded // (2 * self.cp_size)
            for c in (cp_rank, 2 * self.cp_size - 1 - cp_rank):
                parts.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
        return torch.cat(parts).long()

    def pad(self, row: torch.Tensor, fill: float | int = 0, dim: int = -1) -> torch.Tensor:
        """The unpadded ``row`` (``sum(lengths)`` along ``dim``) placed into the padded row."""
        dim = dim % row.dim()
        shape = list(row.shape)
        shape[dim] = sum(self.padded_lengths)
        out = torch.full(shape, fill, dtype=row.dtype, device=row.device)
        index = self.padded_positions().to(row.device)
        return out.index_copy(dim, index, row.narrow(dim, 0, sum(self.lengths)))

    def shard(self, padded_row: torch.Tensor, cp_rank: int, dim: int = -1) -> torch.Tensor:
        """CP rank ``cp_rank``'s part of ``padded_row``."""
        return padded_row.index_select(dim, self.rank_positions(cp_rank).to(padded_row.device))

    def unshard(self, shards: Sequence[torch.Tensor], dim: int = -1) -> torch.Tensor:
        """The padded row from every rank's part (``shards[r]`` from rank ``r``)."""
        if len(shards) != self.cp_size:
            raise ValueError(f"expected {self.cp_size} shards, got {len(shards)}")
        local = torch.cat(list(shards), dim=dim)
        order = torch.cat([self.rank_positions(r) for r in range(self.cp_size)])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        return local.index_select(dim, inverse.to(local.device))

    def unpad(self, padded_row: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Drop the padding: the inverse of :meth:`pad`."""
        return padded_row.index_select(dim, self.padded_positions().to(padded_row.device))
