"""Rank function for test_sdpa_attention (spawned with the megatron CPU shim)."""

from __future__ import annotations

import torch


def _config(heads: int, groups: int, head_dim: int, scaling: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        apply_query_key_layer_scaling=scaling,
        use_cpu_initialization=True,
    )


def reference(q, k, v, allowed, scale):
    """float64 ``softmax(scale q k^T, allowed) v`` per head; q ``[s, b, h, d]``, k/v
    ``[s, b, g, d]`` (groups repeated), allowed ``[s, s]``; out ``[s, b, h * d]``."""
    q, k, v = (t.double() for t in (q, k, v))
    rep = q.size(2) // k.size(2)
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), v)
    return out.reshape(q.size(0), q.size(1), -1)


CASES = {  # (heads, query groups, packing mask, query-key layer scaling)
    "gqa, packed": (4, 2, True, False),
    "mha, causal without a mask": (4, 4, False, False),
    "mqa, packed, layer scaling": (4, 1, True, True),
}


def compare_all(rank: int, world: int) -> dict:
    """:func:`compare` for every case, and the local spec's core attention class names."""
    from megatron.core import parallel_state as ps
    from miles_megatron.local_spec import local_block_spec

    ps.initialize_model_parallel()
    spec = local_block_spec({"normalization": "RMSNorm"}, _config(4, 2, 8, False))
    classes = {
        layer.submodules.self_attention.submodules.core_attention.__name__
        for layer in spec.layer_specs
    }
    return {"classes": classes, **{name: compare(*case) for name, case in CASES.items()}}


def compare(heads: int, groups: int, with_mask: bool, scaling: bool) -> dict:
    """Forward and input gradients of SDPAttention and megatron's DotProductAttention on the
    same inputs, and both against the float64 reference. Returns the largest differences."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from miles_megatron.sdpa_attention import SDPAttention

    head_dim, seq = 8, 24
    config = _config(heads, groups, head_dim, scaling)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(seq, 1, heads, head_dim, generator=gen)
    k = torch.randn(seq, 1, groups, head_dim, generator=gen)
    v = torch.randn(seq, 1, groups, head_dim, generator=gen)
    causal = torch.ones(seq, seq).tril().bool()
    if with_mask:  # three packed samples of 10, 9 and 5 tokens
        segment = torch.repeat_interleave(torch.arange(3), torch.tensor([10, 9, 5]))
        allowed = causal & (segment[:, None] == segment[None, :])
    else:
        allowed = causal
    explicit = (~allowed)[None, None]  # megatron masks where True
    # without a mask SDPAttention is causal by itself; megatron's module builds its default
    # causal mask on a GPU, so on the CPU it gets the same mask explicitly
    masks = {"sdpa": explicit if with_mask else None, "megatron": explicit}
    results = {}
    for name, cls in (("sdpa", SDPAttention), ("megatron", DotProductAttention)):
        mask = masks[name]
        module = cls(
            config, layer_number=2, attn_mask_type=AttnMaskType.causal, attention_type="self"
        )
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = module(*inputs, mask)
        out.backward(torch.ones_like(out))
        results[name] = (out.detach(), [t.grad for t in inputs])
    scale = 1.0 / head_dim**0.5
    ref_inputs = [t.double().requires_grad_() for t in (q, k, v)]
    ref = reference(*ref_inputs, allowed, scale)
    ref.backward(torch.ones_like(ref))
    out, grads = results["sdpa"]
    return {
        "vs_reference": (out.double() - ref).abs().max().item(),
        "grads_vs_reference": max(
            (g.double() - r.grad).abs().max().item() for g, r in zip(grads, ref_inputs)
        ),
        "vs_megatron": (out - results["megatron"][0]).abs().max().item(),
        "grads_vs_megatron": max(
            (a - b).abs().max().item() for a, b in zip(grads, results["megatron"][1])
        ),
    }
