"""Rank functions for test_megatron_varlen (spawned with the megatron CPU shim)."""

from __future__ import annotations

import dataclasses

import torch

#: five samples of different lengths (one of a single response token), packed into one row
LENGTHS = ((23, 6), (5, 2), (41, 9), (2, 1), (17, 4))


def packed_samples(seed: int = 3):
    from miles_core.batch import Sample

    gen = torch.Generator().manual_seed(seed)
    return [
        Sample(
            tokens=torch.randint(0, 96, (length,), generator=gen),
            response_length=response,
            reward=float(i % 2),
            group_index=i // 2,
        )
        for i, (length, response) in enumerate(LENGTHS)
    ]


def _logits_and_grads(model, shard, implementation: str, weights: torch.Tensor):
    """Float64 logits of the packed row through :func:`stage_forward` under ``implementation``,
    and every parameter's gradient of ``sum(logits * weights)``."""
    from miles_megatron.packed_attention import CONFIG_ATTR
    from miles_megatron.schedule import stage_forward

    setattr(model.config, CONFIG_ATTR, implementation)
    model.zero_grad(set_to_none=True)
    logits = stage_forward(model, shard)[..., : weights.shape[-1]]
    (logits * weights).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return logits.detach(), grads


def varlen_vs_masked(rank: int, world: int, hf_dir: str, tp: int) -> dict:
    """At TP = ``tp``: the model built with ``--attn-implementation varlen`` (float64) on one
    packed row of :data:`LENGTHS`: the largest logit and gradient differences between the varlen
    and the masked path, with the row's real boundaries and with none (one segment)."""
    from megatron_ranks import build_from_hf, layout_argv
    from miles_core.batch import RolloutBatch
    from miles_core.packing import pack_thd
    from miles_megatron.context_parallel import PackedShard, row_pad_multiple
    from miles_megatron.packed_attention import attn_implementation_of

    argv = [*layout_argv(tp=tp), "--attn-implementation", "varlen"]
    _, margs, model, _ = build_from_hf(hf_dir, argv)
    resolved = attn_implementation_of(model)
    model = model.double()
    packed = pack_thd(RolloutBatch(packed_samples()), pad_multiple=row_pad_multiple())
    shard = PackedShard.of(packed, 1, 0, None)
    gen = torch.Generator().manual_seed(5)
    weights = torch.randn(1, packed.num_tokens, margs["vocab_size"], generator=gen).double()
    masked, masked_grads = _logits_and_grads(model, shard, "sdpa", weights)
    out: dict = {"resolved": resolved, "segments": len(packed.cu_seqlens) - 1}
    no_bounds = dataclasses.replace(
        packed,
        cu_seqlens=torch.tensor([0, packed.num_tokens], dtype=torch.int32),
        max_seqlen=packed.num_tokens,
    )
    for label, row in (("right", packed), ("no_boundaries", no_bounds)):
        logits, grads = _logits_and_grads(model, PackedShard.of(row, 1, 0, None), "varlen", weights)
        out[label] = {
            "logits": (logits - masked).abs().max().item(),
            "grads": max((grads[n] - g).abs().max().item() for n, g in masked_grads.items()),
        }
    out["logit_scale"] = masked.abs().max().item()
    out["grad_scale"] = max(g.abs().max().item() for g in masked_grads.values())
    return out


def one_step(rank: int, world: int, hf_dir: str, tp: int, drop_boundaries: bool) -> dict:
    """One MegatronBackend.train step (fp32) under each --attn-implementation: loss and grad
    norm. ``drop_boundaries``: the varlen run's rows carry no sample boundaries (one segment
    each), the wrong cu_seqlens the test must notice."""
    from megatron_ranks import layout_argv, parse
    from miles_core.batch import RolloutBatch
    from miles_megatron import schedule
    from miles_megatron.backend import MegatronBackend

    real_mask = schedule.varlen_mask
    if drop_boundaries:

        def one_segment(cu_seqlens, max_seqlen):
            total = int(cu_seqlens[-1])
            return real_mask(torch.tensor([0, total], dtype=torch.int32), total)

        schedule.varlen_mask = one_segment
    out = {}
    try:
        for implementation in ("sdpa", "varlen"):
            argv = ["--hf-checkpoint", hf_dir, "--lr", "1e-3", "--weight-decay", "0"]
            argv += ["--advantage-estimator", "grpo", "--micro-batch-size", "5"]
            argv += ["--entropy-coef", "0.01", *layout_argv(tp=tp)]
            argv += ["--attn-implementation", implementation]
            backend = MegatronBackend()
            backend.init(parse(argv))
            batch = RolloutBatch(packed_samples()) if backend.data_layout().consumes_data else None
            metrics = backend.train(0, batch)
            out[implementation] = {k: float(metrics[k]) for k in ("loss", "grad_norm")}
            backend.close()
    finally:
        schedule.varlen_mask = real_mask
    return out
