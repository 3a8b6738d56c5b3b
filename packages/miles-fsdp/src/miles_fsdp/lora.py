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

Loaded adapters must be plain LoRA: DoRA (``use_dora``), trained biases (``bias`` other than
``"none"``) and ``modules_to_save`` are rejected, naming the file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from miles_core.args import ArgumentError
from torch import nn

ADAPTER_NAME = "default"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


class AdapterError(ValueError):
    """A PEFT adapter directory cannot be used; the message names the file."""


@dataclass(frozen=True)
class LoRASettings:
    """``--lora-rank``, ``--lora-alpha``, ``--lora-dropout``, ``--lora-target-modules``."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("all-linear",)

    @classmethod
    def from_args(cls, args: Any) -> LoRASettings:
        return cls(
            rank=args.lora_rank,
            alpha=float(args.lora_alpha),
            dropout=args.lora_dropout,
            target_modules=tuple(args.lora_target_modules),
        )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def peft_config(self) -> Any:
        from peft import LoraConfig

        targets = self.target_modules
        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules="all-linear" if targets == ("all-linear",) else list(targets),
            bias="none",
        )


@dataclass(frozen=True)
class Adapter:
    """A plain PEFT adapter directory read from disk (``save_pretrained`` output)."""

    path: Path
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    weights: dict[str, torch.Tensor]  # "<module>.lora_A.weight" / "<module>.lora_B.weight"

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def read_adapter(path: str | Path) -> Adapter:
    """Read and check a PEFT adapter directory (config and safetensors weights)."""
    from safetensors.torch import load_file

    path = Path(path)
    config_file = path / ADAPTER_CONFIG
    if not config_file.is_file():
        raise AdapterError(f"{config_file}: missing (not a PEFT adapter directory)")
    try:
        cfg = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise AdapterError(f"{config_file}: invalid JSON ({exc})") from exc
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{config_file}: peft_type {cfg['peft_type']!r} is not LORA")
    if cfg.get("use_dora"):
        raise AdapterError(f"{config_file}: DoRA adapters (use_dora) are not supported")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"{config_file}: adapters with trained biases (bias={cfg['bias']!r})")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"{config_file}: modules_to_save is not supported")
    if cfg.get("use_rslora"):
        raise AdapterError(f"{config_file}: rsLoRA scaling (use_rslora) is not supported")
    weights_file = path / ADAPTER_WEIGHTS
    if not weights_file.is_file():
        raise AdapterError(f"{weights_file}: missing")
    weights = {}
    for name, tensor in load_file(str(weights_file)).items():
        short = name.removeprefix(PEFT_PREFIX)
        if not short.endswith((".lora_A.weight", ".lora_B.weight")):
            raise AdapterError(f"{weights_file}: unexpected tensor {name} (plain LoRA only)")
        weights[short] = tensor
    targets = cfg.get("target_modules") or ()
    return Adapter(
        path=path,
        rank=int(cfg["r"]),
        alpha=float(cfg["lora_alpha"]),
        target_modules=(targets,) if isinstance(targets, str) else tuple(targets),
        weights=weights,
    )


def check_adapter_matches(adapter: Adapter, settings: LoRASettings) -> None:
    """The actor's adapter must have the flags' ``r`` and ``lora_alpha``."""
    if adapter.rank != settings.rank or adapter.alpha != settings.alpha:
        raise ArgumentError(
            f"{adapter.path / ADAPTER_CONFIG}: r={adapter.rank}, lora_alpha={adapter.alpha:g}, "
            f"but --lora-rank {settings.rank} --lora-alpha {settings.alpha:g}: pass "
            f"--lora-rank {adapter.rank} --lora-alpha {adapter.alpha:g}"
        )


def settings_for(adapter: Adapter, settings: LoRASettings) -> LoRASettings:
    """The flags' settings with the loaded adapter's target modules (so its weights fit)."""
    return LoRASettings(settings.rank, settings.alpha, settings.dropout, adapter.target_modules)


def inject_lora(model: nn.Module, settings: LoRASettings, on_meta: bool) -> nn.Module:
    """Wrap the target linears of ``model`` with PEFT LoRA layers; only adapters train."""
    from peft import inject_adapter_in_model

    model = inject_adapter_in_model(
        settings.peft_config(), model, adapter_name=ADAPTER_NAME, low_cpu_mem_usage=on_meta
    )
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_name(name))
    return model


def is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _adapter_targets(model: nn.Module, adapter: Adapter) -> dict[str, nn.Module]:
    modules = dict(model.named_modules())
    out = {}
    for key in adapter.weights:
        module_name = key.rsplit(".lora_", 1)[0]
        if module_name not in modules:
            raise AdapterError(
                f"{adapter.path / ADAPTER_WEIGHTS}: {key} names no module of the model"
            )
        out[module_name] = modules[module_name]
    return out


@torch.no_grad()
def load_adapter_weights(model: nn.Module, adapter: Adapter) -> None:
    """Copy ``adapter``'s A/B into the injected layers of a (full, rank-0) model."""
    for module_name, module in _adapter_targets(model, adapter).items():
        for part in ("lora_A", "lora_B"):
            layer = getattr(module, part, None)
            if layer is None or ADAPTER_NAME not in layer:
                raise AdapterError(
                    f"{adapter.path / ADAPTER_WEIGHTS}: {module_name} is not a LoRA target of "
                    "the model (--lora-target-modules)"
                )
            src = adapter.weights[f"{module_name}.{part}.weight"]
            dst = layer[ADAPTER_NAME].weight
            if src.shape != dst.shape:
                raise AdapterError(
                    f"{adapter.path / ADAPTER_WEIGHTS}: {module_name}.{part} has shape "
                    f"{tuple(src.shape)}, the model needs {tuple(dst.shape)}"
                )
            dst.copy_(src.to(dst.dtype))


@torch.no_grad()
def merge_adapter_into(model: nn.Module, adapter: Adapter) -> None:
    """Add ``(alpha / r) * B @ A`` to each target linear's weight (frozen roles, rank 0)."""
    for module_name, module in _adapter_targets(model, adapter).items():
        a = adapter.weights[f"{module_name}.lora_A.weight"].double()
        b = adapter.weights[f"{module_name}.lora_B.weight"].double()
        weight = module.weight
        delta = adapter.scale * (b @ a)
        if delta.shape != weight.shape:
            raise AdapterError(
                f"{adapter.path / ADAPTER_WEIGHTS}: {module_name} adapter gives "
                f"{tuple(delta.shape)}, the weight is {tuple(weight.shape)}"
            )
        weight.copy_((weight.double() + delta).to(weight.dtype))


def actor_lora_fixup(settings: LoRASettings, adapter: Adapter | None) -> Callable:
    """Post-load fixup for rank 0's full actor: inject LoRA, then load ``adapter`` if given."""

    def fixup(model: nn.Module, config: Any) -> None:
        inject_lora(model, settings, on_meta=False)
        if adapter is not None:
            load_adapter_weights(model, adapter)

    return fixup


def merge_fixup(adapter: Adapter) -> Callable:
    """Post-load fixup for a frozen role: merge ``adapter`` into its base weights."""

    def fixup(model: nn.Module, config: Any) -> None:
        merge_adapter_into(model, adapter)

    return fixup


def lora_layers(model: nn.Module) -> list[nn.Module]:
    """PEFT's tuner layers inside ``model``."""
    from peft.tuners.tuners_utils import BaseTunerLayer

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


def actor_lora(args: Any) -> tuple[LoRASettings | None, Adapter | None]:
    """``--use-lora``: the actor's settings and its ``--lora-adapter-path`` adapter, checked."""
    if not args.use_lora:
        return None, None
    settings = LoRASettings.from_args(args)
    if not args.lora_adapter_path:
        return settings, None
    adapter = read_adapter(args.lora_adapter_path[0])  # a causal LM has one component
    check_adapter_matches(adapter, settings)
    return settings_for(adapter, settings), adapter
