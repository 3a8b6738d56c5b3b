"""Test support: per-rank bodies of the megatron LoRA tests (importable by spawn children)."""

from __future__ import annotations

from typing import Any

import torch
from megatron_ranks import build_from_hf, layout_argv


def logits_with_grad(model, input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    s = input_ids.shape[1]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    positions = torch.arange(s)[None].expand_as(input_ids)
    return model(input_ids, positions, attention_mask=mask)[..., :vocab_size]


def lora_model(hf_dir: str, adapter_dir: str | None, tp: int, extra: list[str] = ()):
    """Megatron model from ``hf_dir`` with LoRA, factors from ``adapter_dir`` (or fresh)."""
    from miles_megatron.lora import (
        LoRAConfig,
        init_fresh,
        inject_lora,
        load_factors,
        read_adapter_dir,
    )

    args, margs, model, bridge = build_from_hf(hf_dir, [*layout_argv(tp=tp), *extra])
    if adapter_dir is not None:
        adapter = read_adapter_dir(adapter_dir)
        config = LoRAConfig(adapter.rank, adapter.alpha, 0.0, adapter.target_modules)
        injected = inject_lora(model, bridge, margs, config)
        load_factors(injected, adapter)
    else:
        config = LoRAConfig.from_args(args)
        injected = inject_lora(model, bridge, margs, config)
        init_fresh(injected, seed=1234)
    return args, margs, model, bridge, injected, config


def adapter_grads(injected) -> dict[str, torch.Tensor]:
    """Full (TP/EP-gathered) adapter gradients keyed ``<hf module>.lora_A|lora_B``."""
    out = {}
    for _, adapter in injected:
        for factor in ("lora_A", "lora_B"):
            for short, param in getattr(adapter, factor).items():
                out[f"{adapter.hf_names[short]}.{factor}"] = adapter.full_of(factor, param.grad)
    return out


def logits_and_grads_match(
    rank: int,
    world: int,
    hf_dir: str,
    adapter_dir: str,
    input_ids: torch.Tensor,
    loss_weights: torch.Tensor,
    ref_logits: torch.Tensor,
    ref_grads: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """Max |megatron - PEFT| of the logits and of every adapter gradient at TP = world."""
    _, margs, model, _, injected, _ = lora_model(hf_dir, adapter_dir, tp=world)
    logits = logits_with_grad(model, input_ids, margs["vocab_size"])
    (logits.float() * loss_weights).sum().backward()
    grads = adapter_grads(injected)
    frozen_grads = [
        n
        for n, p in model.named_parameters()
        if p.grad is not None and not getattr(p, "lora_adapter", False)
    ]
    return {
        "logits": (logits.detach() - ref_logits).abs().max().item(),
        "grads": {k: (grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads},
        "grad_scale": {k: ref_grads[k].abs().max().item() for k in ref_grads},
        "extra": sorted(set(grads) - set(ref_grads)),
        "frozen_grads": frozen_grads,
    }
