"""LoRA adapters through PEFT, for the actor (trained) and the frozen roles (merged).

Actor (``--use-lora``): PEFT's ``inject_adapter_in_model`` wraps the target linears of the meta
model before ``fully_shard`` (adapter ``"default"``), so each wrapped linear holds a frozen
``base_layer`` and trainable ``lora_A`` / ``lora_B``; rank 0 injects the same adapter into its
``from_pretrained`` copy (a post-load fixup), fills it from ``--lora-adapter-path`` when given,
and the full state is broadcast into the shards as usual. The forward of a wrapped linear is::

    y = x W^T + (alpha / r) * (dropout(x) A^T) B^T

Checkpoints hold the adapter only; published and exported weights are merged into the base
checkpoint's names: ``W + (alpha / r) * B @ A`` (:func:`merge_lora_tensors`).

Frozen roles (``--ref-lora-adapter-path``, ``--teacher-lora-adapter-path``): rank 0 adds
``(alpha / r) * B @ A`` of the adapter's own ``r`` / ``lora_alpha`` into the base weights
before the broadcast; the role then runs as a plain model.

Adapter directories are read by :func:`miles_core.peft_adapter.read_peft_adapter`, which
accepts plain LoRA only (DoRA, rsLoRA, trained biases, ``modules_to_save``, ... are rejected,
naming the file and field).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from miles_core.args.parsed import ParsedArgs
from miles_core.peft_adapter import (
    ALL_LINEAR,
    LoRAConfig,
    PeftAdapter,
    PeftAdapterError,
    check_matches_flags,
    read_peft_adapter,
)
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

ADAPTER_NAME = "default"


def peft_lora_config(config: LoRAConfig) -> Any:
    """``config`` as peft's ``LoraConfig`` (no bias adapters)."""
    targets = config.target_modules
    if not isinstance(targets, str):
        targets = ALL_LINEAR if targets == (ALL_LINEAR,) else list(targets)
    return LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=targets,
        bias="none",
    )


def inject_lora(model: nn.Module, settings: LoRAConfig, on_meta: bool) -> nn.Module:
    """Wrap the target linears of ``model`` with PEFT LoRA layers; only adapters train."""
    model = inject_adapter_in_model(
        peft_lora_config(settings), model, adapter_name=ADAPTER_NAME, low_cpu_mem_usage=on_meta
    )
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_name(name))
    return model


def is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _adapter_targets(model: nn.Module, adapter: PeftAdapter) -> dict[str, nn.Module]:
    modules = dict(model.named_modules())
    out = {}
    for module_name in adapter.factors:
        if module_name not in modules:
            raise PeftAdapterError(
                f"{adapter.weights_file}: {module_name} names no module of the model"
            )
        out[module_name] = modules[module_name]
    return out


@torch.no_grad()
def load_adapter_weights(model: nn.Module, adapter: PeftAdapter) -> None:
    """Copy ``adapter``'s A/B into the injected layers of a (full, rank-0) model."""
    for module_name, module in _adapter_targets(model, adapter).items():
        for part in ("lora_A", "lora_B"):
            layer = getattr(module, part, None)
            if layer is None or ADAPTER_NAME not in layer:
                raise PeftAdapterError(
                    f"{adapter.weights_file}: {module_name} is not a LoRA target of "
                    "the model (--lora-target-modules)"
                )
            src = adapter.factors[module_name][part]
            dst = layer[ADAPTER_NAME].weight
            if src.shape != dst.shape:
                raise PeftAdapterError(
                    f"{adapter.weights_file}: {module_name}.{part} has shape "
                    f"{tuple(src.shape)}, the model needs {tuple(dst.shape)}"
                )
            dst.copy_(src.to(dst.dtype))


@torch.no_grad()
def merge_adapter_into(model: nn.Module, adapter: PeftAdapter) -> None:
    """Add ``(alpha / r) * B @ A`` to each target linear's weight (frozen roles, rank 0)."""
    for module_name, module in _adapter_targets(model, adapter).items():
        a = adapter.factors[module_name]["lora_A"].double()
        b = adapter.factors[module_name]["lora_B"].double()
        weight = module.weight
        delta = adapter.scale * (b @ a)
        if delta.shape != weight.shape:
            raise PeftAdapterError(
                f"{adapter.weights_file}: {module_name} adapter gives "
                f"{tuple(delta.shape)}, the weight is {tuple(weight.shape)}"
            )
        weight.copy_((weight.double() + delta).to(weight.dtype))


def actor_lora_fixup(settings: LoRAConfig, adapter: PeftAdapter | None) -> Callable:
    """Post-load fixup for rank 0's full actor: inject LoRA, then load ``adapter`` if given."""

    def fixup(model: nn.Module, config: Any) -> None:
        inject_lora(model, settings, on_meta=False)
        if adapter is not None:
            load_adapter_weights(model, adapter)

    return fixup


def merge_fixup(adapter: PeftAdapter) -> Callable:
    """Post-load fixup for a frozen role: merge ``adapter`` into its base weights."""

    def fixup(model: nn.Module, config: Any) -> None:
        merge_adapter_into(model, adapter)

    return fixup


def lora_layers(model: nn.Module) -> list[nn.Module]:
    """PEFT's tuner layers inside ``model``."""
    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


BASE_SUFFIX = ".base_layer.weight"


def continues_lora_module(name: str) -> bool:
    """Whether the tensor after ``name`` in state-dict order belongs to the same LoRA module
    (a weight source must gather the base and both factors together to merge them)."""
    return ".base_layer." in name or ".lora_A." in name


def merge_lora_tensors(
    named: list[tuple[str, torch.Tensor]], scale: float
) -> list[tuple[str, torch.Tensor]]:
    """Full tensors of a LoRA model -> full tensors in the base model's names.

    ``x.base_layer.weight`` becomes ``x.weight = W + scale * B @ A`` (computed in fp32 or
    wider), ``x.base_layer.bias`` becomes ``x.bias``, adapter factors are dropped.
    """
    full = dict(named)
    out = []
    for name, tensor in named:
        if is_adapter_name(name):
            continue
        if name.endswith(BASE_SUFFIX):
            prefix = name[: -len(BASE_SUFFIX)]
            a = full[f"{prefix}.lora_A.{ADAPTER_NAME}.weight"]
            b = full[f"{prefix}.lora_B.{ADAPTER_NAME}.weight"]
            work = torch.promote_types(tensor.dtype, torch.float32)
            merged = tensor.to(work) + scale * (b.to(work) @ a.to(work))
            out.append((f"{prefix}.weight", merged.to(tensor.dtype)))
        else:
            out.append((name.replace(".base_layer.", "."), tensor))
    return out


def actor_lora(args: ParsedArgs) -> tuple[LoRAConfig | None, PeftAdapter | None]:
    """``--use-lora``: the actor's settings and its ``--lora-adapter-path`` adapter, checked."""
    if not args.use_lora:
        return None, None
    settings = LoRAConfig.from_roles(args.run_config.roles)
    if not args.lora_adapter_path:
        return settings, None
    adapter = read_peft_adapter(args.lora_adapter_path[0])  # a causal LM has one component
    check_matches_flags(adapter, settings.rank, settings.alpha)
    return settings.with_targets(adapter.target_modules), adapter
