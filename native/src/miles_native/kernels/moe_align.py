"""Token sort/align by expert: the block-padded row order the grouped GEMMs walk.

Assignments ``a = t * k + j`` (token ``t``'s ``j``-th expert) are sorted stably by expert, and
each expert's group is padded to a multiple of ``block_m`` with the sentinel ``S = T * k``, so
that every row block of ``block_m`` rows belongs to one expert. Sizes are upper bounds known
on the host (``P_max = S + E * (block_m - 1)`` rounded up to ``block_m``), so nothing here
waits for the device; kernels skip row blocks whose ``block_expert`` is ``-1``.
"""

from dataclasses import dataclass

import torch

from miles_native.kernels.fused_moe_kernels import moe_align_kernel


@dataclass
class MoEAlignment:
    sorted_ids: torch.Tensor  # int32 [P_max]: assignment id per aligned row, S on pad rows
    block_expert: torch.Tensor  # int32 [P_max // block_m]: expert of each row block, or -1
    expert_pstarts: torch.Tensor  # int32 [E + 1]: padded group offsets (exclusive prefix sum)
    num_assignments: int  # S = T * k
    block_m: int

    @property
    def max_rows(self) -> int:
        return self.sorted_ids.numel()

    @property
    def max_blocks(self) -> int:
        return self.block_expert.numel()


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Sort the ``[T, k]`` routed expert ids by expert and pad each group to ``block_m`` rows.

    Within an expert, assignments keep ascending order (stable sort), which makes every
    reduction over an expert's rows deterministic.
    """
    flat = topk_ids.reshape(-1)
    num_assignments = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int32))
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    pstarts = torch.zeros(num_experts + 1, dtype=torch.int32, device=device)
    torch.cumsum(padded, 0, dtype=torch.int32, out=pstarts[1:])
    order = torch.sort(flat, stable=True).indices.to(torch.int32)

    max_rows = (num_assignments + num_experts * (block_m - 1) + block_m - 1) // block_m * block_m
    sorted_ids = torch.full((max_rows,), num_assignments, dtype=torch.int32, device=device)
    block_expert = torch.full((max_rows // block_m,), -1, dtype=torch.int32, device=device)
    moe_align_kernel[(num_experts,)](
        order,
        counts,
        starts,
        pstarts,
        sorted_ids,
        block_expert,
        num_assignments,
        BLOCK_M=block_m,
        BLOCK=256,
    )
    return MoEAlignment(sorted_ids, block_expert, pstarts, num_assignments, block_m)
