"""Rank program of test_memory_plan_activations.py: the bytes autograd saves while the Megatron
backend trains one rollout of one-sample micro-batches (unique storages, its parameters' buffers
excluded), bf16, sdpa attention, on a gloo CPU rank with the megatron shim. Storages are told
apart by address, so only one micro-batch's are counted exactly (a later one may reuse the
addresses of an earlier one's freed tensors): the test trains one sample."""

from __future__ import annotations

import torch


def saved_bytes(rank: int, world_size: int, hf_dir: str, tokens: int, samples: int) -> int:
    """Bytes of every storage saved for backward during ``train`` of ``samples`` samples of
    ``tokens`` tokens, each its own micro-batch (``--max-tokens-per-gpu tokens``)."""
    from miles_core.args import core_groups, parse_args
    from miles_core.batch import RolloutBatch, Sample
    from miles_core.partition import partition_for_dp
    from miles_megatron.args import megatron_groups
    from miles_megatron.backend import MegatronBackend

    argv = ["--hf-checkpoint", hf_dir, "--lr", "1e-6", "--advantage-estimator", "grpo"]
    argv += ["--bf16", "--attn-implementation", "sdpa", "--num-steps-per-rollout", "1"]
    argv += ["--use-dynamic-batch-size", "--max-tokens-per-gpu", str(tokens)]
    backend = MegatronBackend()
    backend.init(parse_args(argv, [*core_groups(), *megatron_groups()]))
    models = backend.model if isinstance(backend.model, list) else [backend.model]
    params = {p.untyped_storage().data_ptr() for m in models for p in m.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    g = torch.Generator().manual_seed(0)
    batch = RolloutBatch(
        [
            Sample(
                tokens=torch.randint(2, 500, (tokens,), generator=g),
                response_length=tokens // 2,
                reward=float(i),
                group_index=0,
            )
            for i in range(samples)
        ]
    )
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        backend.train(0, partition_for_dp(batch, 1)[0])
    backend.close()
    return sum(seen.values())
