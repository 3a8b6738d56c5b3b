"""One model-building path for every role: the actor, the reference and the teacher.

:func:`build_model` runs the same sequence for each role, so the architecture's adaptations,
the expert kernel (``--moe-kernel``), routing replay (R3) and the precision policy apply to
every role by construction:

1. the architecture's model patches (``register_model_patch``), then the skeleton on ``meta``;
2. instance and packing patches, the expert kernel, the routing-replay router patch (every
   role's routers read the one :class:`~miles_fsdp.adaptations.moe.RoutingReplay`, so a MoE
   reference or teacher routes a packed row to the experts the actor replays);
3. the actor's trainable LoRA adapter (on meta), or ``requires_grad_(False)`` for a frozen role;
   gradient checkpointing for a trainable role that asks for it;
4. ``fully_shard`` with the precision policy (per-module compute dtypes included) and, for a
   CPU-offloaded role, FSDP2's ``CPUOffloadPolicy``; before it, with
   ``--compile-decoder-layers``, each decoder layer's forward compiled
   (:mod:`miles_core.compiled_layers`; FSDP's hooks run around the forward either way);
5. rank 0 reads the weights (``from_pretrained``) and runs the post-load fixups: the
   architecture's (``register_post_load_fixup``), then the role's own (LoRA load / merge);
6. materialise where :func:`placement` says and fill from rank 0; train or eval mode.

What differs between roles is a :class:`RoleSpec`; what they share is a :class:`BuildPlan`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from miles_core import batch_invariant
from miles_core.compiled_layers import compile_layers
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from miles_fsdp.adaptations import Adaptation
from miles_fsdp.adaptations.moe import RoutingReplay, apply_moe_kernel, install_routing_replay
from miles_fsdp.loading import (
    build_meta_model,
    fill_sharded_model,
    finish_lazy_init,
    read_full_state,
)
from miles_fsdp.lora import inject_lora
from miles_fsdp.precision import PrecisionConfig
from miles_fsdp.wrapping import apply_fsdp, decoder_layers


@dataclass(frozen=True)
class BuildPlan:
    """What every role of a run shares (the actor's architecture, precision, mesh, kernels)."""

    adaptation: Adaptation
    precision: PrecisionConfig
    attn_implementation: str
    mesh: Any
    device: torch.device
    moe_kernel: str | None = None
    #: ``--use-rollout-routing-replay``: the replay every role's routers read (``None``: off)
    routing_replay: RoutingReplay | None = None
    #: ``--compile-decoder-layers``: every role's decoder layers run compiled forwards
    compile_layers: bool = False
    #: ``--true-on-policy``: a checkpointed layer's recompute runs in the batch-invariant mode too
    batch_invariant: bool = False


@dataclass(frozen=True)
class RoleSpec:
    """What differs between roles: where the weights are, whether they train, offload, LoRA."""

    role: str  # "actor", "critic", "reference", "teacher"
    path: Path
    config: Any
    trainable: bool
    cpu_offload: bool = False
    #: the actor's trainable adapter (``miles_core.peft_adapter.LoRAConfig``), injected on meta
    lora: Any = None
    #: the role's own post-load fixups ``(model, config)``, after the architecture's
    fixups: tuple[Callable[[nn.Module, Any], None], ...] = ()
    gradient_checkpointing: bool = False
    #: ``--gradient-checkpointing-layers``: only the first N decoder layers recompute
    checkpoint_layers: int | None = None
    #: the role's own skeleton patches ``(model, config)`` on meta, after the architecture's
    #: (the critic's value head)
    instance_patches: tuple[Callable[[nn.Module, Any], None], ...] = ()


@dataclass(frozen=True)
class Placement:
    """Where a role's sharded parameters and its buffers are materialised."""

    params: torch.device
    buffers: torch.device


def placement(device: torch.device, cpu_offload: bool) -> Placement:
    """Parameters on the CPU for a CPU-offloaded role (FSDP2 copies each unit's shards to the
    accelerator at unshard), else on ``device``; buffers always on ``device``: FSDP does not
    manage buffers, and the forward reads them (rotary ``inv_freq``) next to the activations."""
    return Placement(params=torch.device("cpu") if cpu_offload else device, buffers=device)


def enable_gradient_checkpointing(
    model: nn.Module, layers: int | None = None, batch_invariant: bool = False
) -> None:
    """HF gradient checkpointing (non-reentrant) of every decoder layer, or of the first
    ``layers`` only (``--gradient-checkpointing-layers``): the others keep their activations.
    With ``batch_invariant`` the recompute in the backward runs in
    :func:`miles_core.batch_invariant.mode`, as the forward did (the mode is a thread's, and
    the backward's recompute is not inside the forward's ``with``)."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if batch_invariant:
        kwargs["context_fn"] = _batch_invariant_recompute
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24
        model.activation_checkpointing_enable(kwargs)
    else:
        model.gradient_checkpointing_enable(kwargs)
    if layers is None:
        return
    decoder = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for module in decoder[layers:]:
        module.gradient_checkpointing = False


def _batch_invariant_recompute():
    """``context_fn`` of ``torch.utils.checkpoint``: the forward as it is, the recompute in the
    batch-invariant mode."""
    return contextlib.nullcontext(), batch_invariant.mode()


def build_model(plan: BuildPlan, spec: RoleSpec) -> nn.Module:
    """Build, shard and load one role (collective over the default group); see the module
    docstring for the sequence."""
    config, adaptation, precision = spec.config, plan.adaptation, plan.precision
    for patch in adaptation.model_patches:
        patch(config)
    model = build_meta_model(config, precision.master_dtype, plan.attn_implementation)
    for patch in adaptation.model_instance_patches + adaptation.packing_patches:
        patch(model, config)
    for patch in spec.instance_patches:
        patch(model, config)
    apply_moe_kernel(model, plan.moe_kernel, plan.device.type)
    if plan.routing_replay is not None:
        install_routing_replay(model, config, plan.routing_replay)
    if spec.lora is not None:
        inject_lora(model, spec.lora, on_meta=True)
    if not spec.trainable:
        model.requires_grad_(False)
    elif spec.gradient_checkpointing:
        enable_gradient_checkpointing(model, spec.checkpoint_layers, plan.batch_invariant)
    if plan.compile_layers:  # compiled at the first forward, inside FSDP's and HF's wrappers
        compile_layers(decoder_layers(model))
    apply_fsdp(model, plan.mesh, precision, cpu_offload=spec.cpu_offload)
    state = buffers = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        fixups = [*adaptation.post_load_fixups, *spec.fixups]
        state, buffers = read_full_state(
            spec.path, config, precision.master_dtype, plan.attn_implementation, fixups
        )
    where = placement(plan.device, spec.cpu_offload)
    fill_sharded_model(model, where.params, state, buffers, buffer_device=where.buffers)
    del state, buffers
    finish_lazy_init(model)
    model.train(spec.trainable)
    return model
