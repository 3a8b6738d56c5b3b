"""Frozen model roles (reference, teacher) and the ``lora_base`` reference forward.

A model is a dict of named components (``--update-weight-target-module``); a causal LM has one,
``"model"`` unless that flag names it. The actor, the reference and the teacher each hold the
same components. ``--ref-mode ref`` and ``--teacher-load`` build an *independent* frozen model
of the actor's family from their own HF directory through the actor's build path
(:func:`miles_fsdp.build.build_model`: adaptation patches, expert kernel, routing replay,
attention implementation and precision): eval mode, no gradients, optionally with a PEFT adapter merged in (one directory per component) and with
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
from miles_core.args import ArgumentError
from miles_core.args.groups.roles import derived_ref_mode
from miles_core.args.parsed import ParsedArgs
from miles_core.peft_adapter import read_peft_adapter
from torch import nn

from miles_fsdp.build import RoleSpec
from miles_fsdp.ema import drop_gathered_copies
from miles_fsdp.loading import load_config, validate_on_rank0
from miles_fsdp.lora import lora_layers, merge_fixup

DEFAULT_COMPONENT = "model"


def component_names(args: ParsedArgs) -> list[str]:
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


def ref_mode(args: ParsedArgs) -> str:
    """``--ref-mode``, or the mode the other flags imply when it is unset."""
    return args.ref_mode or derived_ref_mode(args)


def frozen_sources(args: ParsedArgs) -> list[FrozenSource]:
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


def frozen_role(source: FrozenSource, actor_config: Any) -> RoleSpec:
    """The :class:`RoleSpec` of a frozen role: its directory checked (every rank raises the same
    error), its config of the actor's family, its adapters merged after load."""
    validate_on_rank0(source.path)
    config = load_config(source.path)
    if config.model_type != actor_config.model_type:
        raise ArgumentError(
            f"{source.path}: the {source.role} is a {config.model_type!r} model, the actor a "
            f"{actor_config.model_type!r} one (a frozen role shares the actor's family)"
        )
    return RoleSpec(
        role=source.role,
        path=source.path,
        config=config,
        trainable=False,
        cpu_offload=source.cpu_offload,
        fixups=tuple(merge_fixup(read_peft_adapter(p)) for p in source.adapter_paths),
    )


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
