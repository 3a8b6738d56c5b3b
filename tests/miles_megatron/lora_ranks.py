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


LORA_FLAGS = ["--use-lora", "--lora-rank", "4", "--lora-alpha", "8"]


def backend_argv(hf_dir: str, save: str, tp: int, extra: list[str] = ()) -> list[str]:
    from megatron_ranks import BOTH_BACKENDS_FLAGS

    argv = ["--hf-checkpoint", hf_dir, "--save", save, *BOTH_BACKENDS_FLAGS, *LORA_FLAGS]
    return argv + ["--num-steps-per-rollout", "1", *layout_argv(tp=tp), *extra]


def _factor_lists(backend) -> dict[str, list]:
    return {f"{m}.{f}": t[f].tolist() for m, t in backend.lora.factors().items() for f in t}


def _base_params(backend) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().clone()
        for n, p in backend.model.named_parameters()
        if not getattr(p, "lora_adapter", False)
    }


def backend_lora_flow(
    rank: int, world: int, hf_dir: str, adapter_dir: str, save: str, export_dir: str
) -> dict[str, Any]:
    """TP=2: --lora-adapter-path + KL against lora_base, one rollout, sleep/wake x2, a second
    rollout, save, export; a never-slept control; resume at TP=1; flag errors on resume."""
    from backend_reference import samples
    from megatron_ranks import parse
    from miles_core.args import ArgumentError
    from miles_core.batch import RolloutBatch
    from miles_megatron.backend import MegatronBackend

    kl = ["--use-kl-loss", "--kl-loss-coef", "0.5", "--lora-adapter-path", adapter_dir]
    out: dict[str, Any] = {}
    batch = RolloutBatch(samples())
    runs = {}
    for sleep in (True, False):
        backend = MegatronBackend()
        backend.init(parse(backend_argv(hf_dir, save if sleep else save + "_c", world, kl)))
        args = backend.args
        base_before = _base_params(backend)
        losses = [backend.train(0, batch)]
        copied = []
        if sleep:
            out["ref_mode"] = args.ref_mode
            out["trainable_only_adapters"] = all(
                getattr(p, "lora_adapter", False) == p.requires_grad
                for p in backend.model.parameters()
            )
            out["buffer_params_adapters"] = all(
                getattr(p, "lora_adapter", False) for b in backend.model.buffers for p in b.params
            )
            out["ref_log_probs"] = [t.tolist() for t in backend.reference_log_probs(batch)]
            for _ in range(2):
                backend.sleep()
                copied.append(backend.sleeper.host_bytes_copied)
                out.setdefault("asleep_bytes", backend.sleeper.device_bytes())
                backend.wake_up()
            out["copied"] = copied
            out["adapter_bytes"] = sum(
                p.numel() * p.element_size()
                for p in backend.model.parameters()
                if getattr(p, "lora_adapter", False)
            )
        losses.append(backend.train(1, batch))
        base_after = _base_params(backend)
        runs[sleep] = {
            "losses": [m["loss"] for m in losses],
            "kl": [m["kl_loss"] for m in losses],
            "factors": _factor_lists(backend),
            "base_unchanged": all(torch.equal(base_before[k], base_after[k]) for k in base_after),
        }
        if sleep:
            backend.save_model(1)
            backend.export_adapter(export_dir)
            out["merged"] = {k: v.tolist() for k, v in backend.hf_weights()}
            out["peft_named"] = sorted(k for k, _ in backend.lora.adapter_weights())
        backend.close()
    out["runs"] = [runs[True], runs[False]]
    resumed = MegatronBackend()
    next_id = resumed.init(parse(backend_argv(hf_dir, save + "_r", 1, ["--load", save])))
    out["resumed_next_id"] = next_id
    out["resumed_factors"] = _factor_lists(resumed)
    resumed.close()
    errors = {}
    for label, extra in (
        ("rank", ["--load", save, "--lora-rank", "8"]),
        ("no_lora", ["--load", save]),
    ):
        argv = backend_argv(hf_dir, save + "_e", 1, extra)
        if label == "no_lora":
            argv = [a for a in argv if a != "--use-lora"]
        try:
            MegatronBackend().init(parse(argv))
        except ArgumentError as exc:
            errors[label] = str(exc)
        finally:
            from miles_megatron.parallel import destroy_parallel

            destroy_parallel()
    out["errors"] = errors
    return out
