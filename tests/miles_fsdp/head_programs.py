"""Rank programs of the fused log-prob head tests (importable by spawned children)."""

from __future__ import annotations

import torch
from miles_core.batch import RolloutBatch
from miles_core.packing import pack_thd, unpack_response
from miles_fsdp.backend import FSDPBackend
from rank_programs import full_grads
from run_args import make_args


def token_weights(sample_index: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed per-token weights ``(a, b)`` of the test loss ``sum(a * log_prob + b * entropy)``."""
    t = torch.arange(n, dtype=torch.float64)
    return torch.sin(7.0 * sample_index + t), torch.cos(3.0 * sample_index + 0.5 * t)


def head_program(rank, world, cases, samples, out_file):
    """Per case ``(label, hf_dir, temperature, fused)``: ``sum(a lp + b ent)`` over this rank's
    samples (``rank::world``) through the backend's scoring path, backward, full gradients."""
    from miles_fsdp.train_step import packed_scores

    results = {}
    for label, hf_dir, temperature, fused in cases:
        backend = FSDPBackend()
        backend.init(
            make_args(hf_checkpoint=hf_dir, fused_log_probs=fused, rollout_temperature=temperature)
        )
        ctx = backend._rollout_context()
        indices = list(range(rank, len(samples), world))
        packed = pack_thd(RolloutBatch([samples[i] for i in indices])).to(backend.device)
        lp, ent = packed_scores(ctx, packed, temperature)
        loss = lp.new_zeros(())
        values = []
        for i, lp_i, ent_i in zip(
            indices, unpack_response(packed, lp), unpack_response(packed, ent), strict=True
        ):
            a, b = token_weights(i, lp_i.numel())
            loss = loss + (a.float() * lp_i).sum() + (b.float() * ent_i).sum()
            values.append((i, lp_i.detach().clone(), ent_i.detach().clone()))
        (loss * world).backward()  # FSDP averages gradients over the data-parallel ranks
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, values)
        results[label] = {
            "grads": full_grads(backend.model),
            "values": {i: (x, y) for part in gathered for i, x, y in part},
        }
        backend.close()
    if rank == 0:
        torch.save(results, out_file)
