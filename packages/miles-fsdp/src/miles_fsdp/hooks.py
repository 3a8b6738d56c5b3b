"""Custom prepare and loss hooks (``--custom-prepare-path``, ``--custom-loss-function-path``).

Both flags name a function as ``package.module:function`` (or ``package.module.function``).
Hooks receive a :class:`HookContext` whose ``models``, ``reference_models`` and
``teacher_models`` map component names (``--update-weight-target-module``, default
``"model"``) to the sharded modules; a role that was not built maps to nothing. Frozen roles
run in eval mode with no gradients; call them inside ``torch.no_grad()``.

* prepare: ``prepare(ctx, batch) -> RolloutBatch``, once per rollout before the old/reference
  log-probs, e.g. to attach teacher log-probs with ``batch.with_fields(...)``;
* loss: ``loss(ctx, logits, packed, config, denominator) -> (contribution, parts)`` in place of
  miles-core's ``compute_policy_loss`` for every micro-batch: ``logits`` ``[1, T, V]`` of the
  packed row, ``packed`` the :class:`~miles_core.packing.PackedBatch` (its ``fields`` hold
  ``advantages``, ``old_log_probs``, ``ref_log_probs`` and the prepare hook's fields),
  ``config`` the ``LossConfig``; ``contribution`` is back-propagated (divide by
  ``denominator``, see :mod:`miles_fsdp.train_step`), ``parts`` are logged scalars (summed
  over micro-batches and DP ranks, like the built-in loss's parts).

``ctx.logits(model, packed)`` runs any role on the same packed row the actor saw (attention
kept inside each sample, the actor's attention implementation), e.g. a teacher for
distillation.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from miles_core.args import ArgumentError
from miles_core.packing import PackedBatch, packed_attention_kwargs
from torch import nn


@dataclass
class HookContext:
    """What hooks see: the flags and every role's components by name."""

    args: Any
    device: torch.device
    models: dict[str, nn.Module] = field(default_factory=dict)
    reference_models: dict[str, nn.Module] = field(default_factory=dict)
    teacher_models: dict[str, nn.Module] = field(default_factory=dict)
    attn_implementation: str = "sdpa"
    compute_dtype: torch.dtype = torch.float32

    def logits(self, model: nn.Module, packed: PackedBatch) -> torch.Tensor:
        """Logits ``[1, T, V]`` of ``model`` on the packed row (call frozen roles under
        ``torch.no_grad()``)."""
        kwargs = packed_attention_kwargs(packed, self.attn_implementation, self.compute_dtype)
        return model(input_ids=packed.input_ids, **kwargs).logits


def load_hook(spec: str, flag: str) -> Callable:
    """Import ``module:function`` (or ``module.function``); errors name ``flag``."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ArgumentError(f"{flag} {spec}: expected module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ArgumentError(f"{flag} {spec}: cannot import {module_name} ({exc})") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ArgumentError(f"{flag} {spec}: {module_name} has no function {attr}")
    return fn


@dataclass
class Hooks:
    """The loaded hooks (``None`` when the flag is unset) and their context."""

    context: HookContext
    prepare: Callable | None = None
    loss: Callable | None = None

    @classmethod
    def from_args(cls, args: Any, context: HookContext) -> Hooks:
        prepare = loss = None
        if args.custom_prepare_path:
            prepare = load_hook(args.custom_prepare_path, "--custom-prepare-path")
        if args.custom_loss_function_path:
            loss = load_hook(args.custom_loss_function_path, "--custom-loss-function-path")
        return cls(context, prepare, loss)
