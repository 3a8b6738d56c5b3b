"""Rank program of the fused-vs-eager MoE test (importable by spawned children)."""

from __future__ import annotations

import torch
from miles_core.batch import RolloutBatch
from miles_core.partition import partition_for_dp
from miles_fsdp.backend import FSDPBackend
from rank_programs import full_params
from run_args import make_args


def moe_kernel_program(rank, world, hf_dir, samples, out_file, overrides=None):
    """One rollout per ``--moe-kernel``; weights before and after, experts implementation,
    published shapes. ``overrides``: more flags by field name (e.g. the compute dtype)."""
    results = {}
    for kernel in ("eager", "fused"):
        backend = FSDPBackend()
        flags = dict(
            hf_checkpoint=hf_dir,
            moe_kernel=kernel,
            attn_implementation="eager",
            advantage_estimator="grpo",
            clip_grad=0.0,
        )
        backend.init(make_args(**(flags | (overrides or {}))))
        impl = backend.model.config._experts_implementation
        start = full_params(backend.model)
        shard = partition_for_dp(RolloutBatch(samples), world, keep_groups=True)[rank]
        metrics = backend.train(0, shard)
        published = {n: tuple(t.shape) for n, t in backend.weight_source(gather_bytes=1 << 12)}
        results[kernel] = {
            "impl": impl,
            "start": start,
            "params": full_params(backend.model),
            "published": published,
            "pg_loss": metrics["pg_loss"],
        }
        backend.close()
    if rank == 0:
        torch.save(results, out_file)
