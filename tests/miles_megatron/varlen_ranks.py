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


#: (label, --attn-implementation, more flags) of :func:`one_step`'s runs; the last recomputes
#: every layer in the backward (the boundaries must survive megatron's checkpointing)
RUNS = (
    ("sdpa", "sdpa", []),
    ("varlen", "varlen", []),
    (
        "varlen_recompute",
        "varlen",
        ["--recompute-granularity", "full", "--recompute-method", "uniform"]
        + ["--recompute-num-layers", "1"],
    ),
)


def one_step(
    rank: int, world: int, hf_dir: str, tp: int, drop_boundaries: bool, pp: int = 1
) -> dict:
    """One MegatronBackend.train step (fp32) of each of :data:`RUNS` (at ``pp`` > 1 the first
    two) at TP = ``tp``: loss and grad norm. ``drop_boundaries``: the varlen runs' rows carry no
    sample boundaries (one segment each), the wrong cu_seqlens the test must notice."""
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
        for label, implementation, extra in RUNS if pp == 1 else RUNS[:2]:
            argv = ["--hf-checkpoint", hf_dir, "--lr", "1e-3", "--weight-decay", "0"]
            argv += ["--advantage-estimator", "grpo", "--micro-batch-size", "5"]
            argv += ["--entropy-coef", "0.01", *layout_argv(tp=tp, pp=pp), *extra]
            argv += ["--attn-implementation", implementation]
            backend = MegatronBackend()
            backend.init(parse(argv))
            batch = RolloutBatch(packed_samples()) if backend.data_layout().consumes_data else None
            metrics = backend.train(0, batch)
            out[label] = {k: float(metrics[k]) for k in ("loss", "grad_norm")}
            backend.close()
    finally:
        schedule.varlen_mask = real_mask
    return out


def gpu_varlen_vs_masked(rank: int, world: int) -> dict:
    """On a GPU in bf16 (tests/gpu): ``SDPAttention`` at Qwen3-4B's attention shape (32 heads,
    8 groups, head dim 128) on one packed row of 16k tokens, under the varlen boundaries and
    under the block mask: outputs and input gradients must agree to bf16 rounding; returns how
    often the flash varlen kernel ran (once: the varlen call)."""
    import miles_core.varlen_attention as va
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from miles_megatron.packed_attention import block_mask, varlen_mask
    from miles_megatron.sdpa_attention import SDPAttention

    ps.initialize_model_parallel()
    heads, groups, dim = 32, 8, 128
    config = TransformerConfig(
        num_layers=1,
        hidden_size=heads * dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=dim,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    module = SDPAttention(
        config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
    ).cuda()
    lengths = [2048, 512, 4096, 1, 3000, 6727]
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    q, k, v = (
        randn(total, 1, heads, dim),
        randn(total, 1, groups, dim),
        randn(total, 1, groups, dim),
    )
    grad = randn(total, 1, heads * dim)
    flash_calls = []
    original = va._flash

    def counted(*args, **kwargs):
        flash_calls.append(1)
        return original(*args, **kwargs)

    va._flash = counted
    results = {}
    try:
        for name, mask in (
            ("varlen", varlen_mask(cu, max(lengths))),
            ("masked", block_mask(cu, total)),
        ):
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            out = module(*inputs, mask)
            out.backward(grad)
            results[name] = (out.detach(), [t.grad for t in inputs])
    finally:
        va._flash = original
    (out, grads), (ref, ref_grads) = results["varlen"], results["masked"]
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    for mine, theirs in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=5e-2, atol=5e-2)
    return {"flash_calls": len(flash_calls), "max_diff": (out - ref).abs().max().item()}
