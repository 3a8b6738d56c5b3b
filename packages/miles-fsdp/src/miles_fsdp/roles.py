"""Frozen model roles (reference, teacher) and the ``lora_base`` reference forward.

A model is a dict of named components (``--update-weight-target-module``); a causal LM has one,
``"model"`` unless that flag names it. The actor, the reference and the teacher each hold the
same components. ``--ref-mode ref`` and ``--teacher-load`` build an *independent* frozen model
of the actor's family from their own HF directory, on the actor's mesh, with its input
preparation (adaptation patches, attention implementation and precision): eval mode, no
gradients, optionally with a PEFT adapter merged in (one directory per component) and with
FSDP CPU offload (``--ref-cpu-offload`` / ``--teacher-cpu-offload``). They are never
checkpointed: a resumed run rebuilds them from their sources.

``--ref-mode lora_base`` builds nothing: :func:`adapters_disabled` runs the actor without its
adapter under ``torch.no_grad()``. FSDP's lazy init already ran at load time while the adapters
were trainable, so gradient dtypes do not depend on which forward came first; the units are
resharded before the adapters are re-enabled so PEFT sets ``requires_grad`` on the shards,
where the adapter gradients land, not on gathered copies.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from miles_core.args import ArgumentError
from miles_core.peft_adapter import read_peft_adapter
from torch import nn

from miles_fsdp.ema import drop_gathered_copies
from miles_fsdp.loading import (
    build_meta_model,
    fill_sharded_model,
    finish_lazy_init,
    load_config,
    read_full_state,
    validate_on_rank0,
)
from miles_fsdp.lora import lora_layers, merge_fixup
from miles_fsdp.wrapping import apply_fsdp

DEFAULT_COMPONENT = "model"


def component_names(args: Any) -> list[str]:
    """The model's components: ``--update-weight-target-module`` or ``["model"]``.

    A causal LM is one component, so more than one name is an argument error.
    """
    names = list(args.update_weight_target_module or [DEFAULT_COMPONENT])
    if len(names) != 1:
        raise ArgumentError(
            f"--update-weight-target-module: a causal LM has one component, got {len(names)} "
            f"({', '.join(names)})"
        )
    return names


@dataclass(frozen=True)
class FrozenSource:
    """Where a frozen role comes from: its HF directory, adapters, and CPU offload."""

    role: str  # "reference" or "teacher"
    path: Path
    adapter_paths: tuple[str, ...] = ()
    cpu_offload: bool = False


def ref_mode(args: Any) -> str:
    """``--ref-mode``, or the mode the other flags imply when it is unset."""
    from miles_core.args.groups.roles import derived_ref_mode

    return args.ref_mode or derived_ref_mode(args)


def frozen_sources(args: Any) -> list[FrozenSource]:
    """The frozen roles the flags ask for (``--ref-mode ref``, ``--teacher-load``)."""
    out = []
    if ref_mode(args) == "ref":
        out.append(
            FrozenSource(
                "reference",
                Path(args.ref_load),
                tuple(args.ref_lora_adapter_path or ()),
                args.ref_cpu_offload,
            )
        )
    if args.teacher_load:
        out.append(
            FrozenSource(
                "teacher",
                Path(args.teacher_load),
                tuple(args.teacher_lora_adapter_path or ()),
                args.teacher_cpu_offload,
            )
        )
    return out


@dataclass(frozen=True)
class ActorBuild:
    """What a frozen role shares with the actor (see the module docstring)."""

    config: Any
    adaptation: Any
    precision: Any
    attn_implementation: str
    mesh: Any
    device: torch.device


def build_frozen_model(source: FrozenSource, actor: ActorBuild) -> nn.Module:
    """Load ``source`` as a sharded, frozen, eval-mode model (collective)."""
    validate_on_rank0(source.path)
    config = load_config(source.path)
    if config.model_type != actor.config.model_type:
        raise ArgumentError(
            f"{source.path}: the {source.role} is a {config.model_type!r} model, the actor a "
            f"{actor.config.model_type!r} one (a frozen role shares the actor's family)"
        )
    adaptation, precision = actor.adaptation, actor.precision
    for patch in adaptation.model_patches:
        patch(config)
    model = build_meta_model(config, precision.master_dtype, actor.attn_implementation)
    for patch in adaptation.model_instance_patches + adaptation.packing_patches:
        patch(model, config)
    model.requires_grad_(False)
    apply_fsdp(
        model, actor.mesh, precision.mixed_precision_policy(), cpu_offload=source.cpu_offload
    )
    state = buffers = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        fixups = list(adaptation.post_load_fixups)
        fixups += [merge_fixup(read_peft_adapter(p)) for p in source.adapter_paths]
        state, buffers = read_full_state(
            source.path, config, precision.master_dtype, actor.attn_implementation, fixups
        )
    target = torch.device("cpu") if source.cpu_offload else actor.device
    fill_sharded_model(model, target, state, buffers)
    del state, buffers
    finish_lazy_init(model)
    model.eval()
    return model


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """A gradient-free forward of ``model`` without its LoRA adapter (``lora_base``)."""
    layers = lora_layers(model)
    if not layers:
        raise RuntimeError("--ref-mode lora_base: the actor has no LoRA adapter")
    drop_gathered_copies(model)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        with torch.no_grad():
            yield
    finally:
        drop_gathered_copies(model)
        for layer in layers:
            layer.enable_adapters(True)


@contextmanager
def reference_forward(
    actor: nn.Module, reference: nn.Module | None, mode: str
) -> Iterator[nn.Module]:
    """Yields the module whose forward is the KL reference's, under ``torch.no_grad()``."""
    if mode == "ref":
        with torch.no_grad():
            yield reference
    elif mode == "lora_base":
        with adapters_disabled(actor):
            yield actor
    else:
        raise ValueError(f"no reference forward with --ref-mode {mode}")
