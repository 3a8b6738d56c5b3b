"""Context parallelism (``--context-parallel-size``): which tokens of a packed row each CP rank
holds, how its attention sees the others', and how per-token results come back together.

**The split.** A THD-packed micro-batch (miles-core's ``pack_thd``: samples back to back, padded
to a multiple of :func:`pad_multiple`) is one row of ``T`` tokens. It is cut into ``2 * cp``
equal chunks and CP rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` (megatron's zig-zag),
so every rank holds ``T / cp`` tokens. Example, ``T = 8`` at ``cp = 2``::

    rank 0: [0, 1, 6, 7]      rank 1: [2, 3, 4, 5]

The whole row is split, not each sample: megatron-core's rotary embedding at CP > 1
(``get_pos_emb_on_this_cp_rank``) gives a rank exactly these positions of the row's table, so
RoPE needs nothing from us (RoPE is relative, and attention stays inside each sample, so a
sample's offset in the row does not change its result; CP = 1 uses the same row positions).

**Attention** (:class:`~miles_megatron.sdpa_attention.SDPAttention`): each rank's keys and values
are all-gathered over the CP group (:func:`gather_sequence`, whose backward sums the gradient of
every rank's queries into the owner's keys and values), and the rank's queries attend to the
whole row through the mask :meth:`PackedShard.attention_mask`: query at row position ``q`` sees
key ``k`` iff ``k <= q`` and both are in the same ``cu_seqlens`` segment. The keys come in the
gathered order (rank 0's tokens, then rank 1's, ...), and the mask's columns follow it, so
nothing is permuted. A rank's scores are ``[heads, T / cp, T]``: ``1 / cp`` of CP = 1's, the
attention memory that CP divides (docs/miles-megatron.md); the gathered K/V are ``T`` tokens.

**Results.** The last stage's logits are the rank's ``T / cp`` tokens; the per-token loss terms
(log-probs, entropy, KL, the PPO term) are computed there on the shard's targets, loss mask and
fields (:class:`PackedShard`). miles-core's losses are sums over tokens divided by the step's
global denominator (per-sample counts come from ``sample_loss_tokens``, of the whole sample),
so each rank's loss is its share and the shares add up over the CP group: megatron's schedule
multiplies the loss by the CP size and its DDP divides the gradients reduced over DP x CP by
``dp * cp``, which leaves the gradient of the summed shares (:mod:`miles_megatron.schedule`).
Metrics are summed over DP x CP (extremes by maximum or minimum; a per-sample metric's shares
summed over the CP group before the extreme over samples: :mod:`miles_core.metric_reduction`).
OPSM and the sequence-level TIS weights need whole samples and are refused. Log-probs for the rollout come back whole through
:meth:`PackedShard.gather_row`. GSPO's sequence-level ratio is not a sum over tokens and is
refused at CP > 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from miles_core.packing import PAD_MULTIPLE, PackedBatch


def zigzag_positions(total: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Row positions CP rank ``cp_rank`` holds of a row of ``total`` tokens, in its local order:
    chunk ``cp_rank`` then chunk ``2 * cp_size - 1 - cp_rank`` of ``2 * cp_size``."""
    if cp_size < 1:
        raise ValueError(f"--context-parallel-size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} outside [0, {cp_size})")
    if total % (2 * cp_size) and cp_size > 1:
        raise ValueError(f"a row of {total} tokens does not split into 2 x {cp_size} chunks")
    if cp_size == 1:
        return torch.arange(total)
    chunk = total // (2 * cp_size)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def gathered_order(total: int, cp_size: int) -> torch.Tensor:
    """Row positions in the order an all-gather over the CP group lays the ranks' tokens."""
    return torch.cat([zigzag_positions(total, cp_size, r) for r in range(cp_size)])


def pad_multiple(cp_size: int, tp_size: int) -> int:
    """The packed row's length multiple: ``pack_thd``'s 128, and ``2 * cp`` chunks whose
    halves split over TP (sequence parallelism)."""
    return math.lcm(PAD_MULTIPLE, 2 * cp_size * tp_size)


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward: the sum over ranks of the gradient of
    this rank's slice (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        ctx.size = tensor.size(0)
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        rank = dist.get_rank(ctx.group)
        if dist.get_backend(ctx.group) == "gloo":  # gloo has no reduce-scatter
            dist.all_reduce(grad, group=ctx.group)
            return grad.narrow(0, rank * ctx.size, ctx.size).clone(), None
        out = grad.new_empty((ctx.size, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad, group=ctx.group)
        return out, None


def gather_sequence(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """Every CP rank's ``tensor`` (sequence first) concatenated in rank order, with autograd."""
    return _GatherSequence.apply(tensor, group)


@dataclass
class PackedShard:
    """The tokens of one packed micro-batch that this CP rank holds (the whole row at CP = 1).

    The per-token tensors are ``full``'s at ``positions`` (``[1, T / cp]``); the per-sample ones
    (``num_samples``, ``sample_loss_tokens``) are the whole micro-batch's.
    """

    full: PackedBatch
    positions: torch.Tensor  # long [T / cp], row positions in local order
    cp_size: int
    group: Any  # the CP process group (None at CP = 1)

    @classmethod
    def of(cls, packed: PackedBatch, cp_size: int, cp_rank: int, group: Any) -> PackedShard:
        positions = zigzag_positions(packed.num_tokens, cp_size, cp_rank)
        return cls(packed, positions.to(packed.input_ids.device), cp_size, group)

    def _take(self, row: torch.Tensor) -> torch.Tensor:
        return row if self.cp_size == 1 else row.index_select(1, self.positions)

    @property
    def input_ids(self) -> torch.Tensor:
        return self._take(self.full.input_ids)

    @property
    def position_ids(self) -> torch.Tensor:
        return self._take(self.full.position_ids)

    @property
    def targets(self) -> torch.Tensor:
        return self._take(self.full.targets)

    @property
    def loss_mask(self) -> torch.Tensor:
        return self._take(self.full.loss_mask)

    @property
    def sample_ids(self) -> torch.Tensor:
        return self._take(self.full.sample_ids)

    @property
    def fields(self) -> dict[str, torch.Tensor]:
        return {k: self._take(v) for k, v in self.full.fields.items()}

    @property
    def num_samples(self) -> int:
        return self.full.num_samples

    @property
    def sample_loss_tokens(self) -> torch.Tensor:
        return self.full.sample_loss_tokens

    @property
    def num_tokens(self) -> int:
        """Tokens this rank holds, ``T / cp``."""
        return int(self.positions.numel())

    def attention_mask(self) -> torch.Tensor:
        """Boolean ``[1, 1, T / cp, T]``, True where this rank's query may attend to a key of
        the row, keys in the gathered order (:func:`gathered_order`)."""
        cu = self.full.cu_seqlens
        total = self.full.num_tokens
        segment = torch.repeat_interleave(
            torch.arange(len(cu) - 1, device=cu.device), cu.diff().long(), output_size=total
        )
        q = self.positions
        k = gathered_order(total, self.cp_size).to(q.device)
        mask = (segment[q][:, None] == segment[k][None, :]) & (k[None, :] <= q[:, None])
        return mask[None, None]

    def gather_row(self, values: torch.Tensor) -> torch.Tensor:
        """The whole row ``[1, T]`` of per-token ``values`` (``[1, T / cp]``, this rank's),
        from every CP rank (a collective over the CP group; no gradient)."""
        if self.cp_size == 1:
            return values
        values = values.detach().contiguous()
        parts = [torch.empty_like(values) for _ in range(self.cp_size)]
        dist.all_gather(parts, values, group=self.group)
        gathered = torch.cat(parts, dim=1)
        order = gathered_order(self.full.num_tokens, self.cp_size).to(values.device)
        return torch.empty_like(gathered).index_copy_(1, order, gathered)


def shard_micro_batches(micro_batches: list[PackedBatch]) -> list[PackedShard]:
    """This CP rank's shard of each packed micro-batch (megatron's CP group and rank)."""
    cp_size = ps.get_context_parallel_world_size()
    group = ps.get_context_parallel_group() if cp_size > 1 else None
    rank = ps.get_context_parallel_rank()
    return [PackedShard.of(p, cp_size, rank, group) for p in micro_batches]


def row_pad_multiple() -> int:
    """:func:`pad_multiple` of megatron's CP and TP sizes."""
    return pad_multiple(
        ps.get_context_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
    )
