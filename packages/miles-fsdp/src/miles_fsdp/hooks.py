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

  What the hook receives is chosen by the name of its second parameter. ``logits``: the model
  materialises the full logits for it (the dense path, whatever ``--fused-log-probs`` says):
  ``T x V`` in the compute dtype, plus what the hook's own softmax keeps for backward (a
  float32 ``T x V`` or two), the memory that caps ``--max-tokens-per-gpu``. ``scores``: a
  :class:`TokenScores` of the target tokens' log-probs and the entropies ``[1, T]`` (float32,
  at ``config.temperature``, with gradients) from the same head as the built-in loss, lean
  under ``--fused-log-probs``. Another name is refused when the hook is loaded.

``ctx.logits(model, packed)`` runs any role on the same packed row the actor saw (attention
kept inside each sample, the actor's attention implementation), e.g. a teacher for
distillation, and materialises its ``[1, T, V]`` logits; ``ctx.scores(model, packed,
temperature)`` gives the same role's :class:`TokenScores` through the fused head instead
(``--fused-log-probs``; the dense path otherwise).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from miles_core.args import ArgumentError
from miles_core.log_prob_head import dense_log_probs
from miles_core.packing import PackedBatch, packed_attention_kwargs
from miles_core.user_functions import load_function
from torch import nn

from miles_fsdp.output_head import scoring


@dataclass
class TokenScores:
    """Per-position log-prob of the target token and entropy, ``[1, T]`` float32."""

    log_probs: torch.Tensor
    entropy: torch.Tensor


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

    def scores(self, model: nn.Module, packed: PackedBatch, temperature: float) -> TokenScores:
        """:class:`TokenScores` of ``model`` on the packed row at ``temperature``, through the
        fused head under ``--fused-log-probs`` (no ``[T, V]`` logits)."""
        if self.args.fused_log_probs:
            with scoring(model, packed.targets, temperature):
                out = self.logits(model, packed)
            return TokenScores(out[..., 0], out[..., 1])
        return TokenScores(
            *dense_log_probs(self.logits(model, packed), packed.targets, temperature, True)
        )


@dataclass
class Hooks:
    """The loaded hooks (``None`` when the flag is unset) and their context."""

    context: HookContext
    prepare: Callable | None = None
    loss: Callable | None = None
    #: the loss hook's second parameter is ``logits`` (else ``scores``)
    loss_wants_logits: bool = False

    @classmethod
    def from_args(cls, args: Any, context: HookContext) -> Hooks:
        prepare = loss = None
        if args.custom_prepare_path:
            prepare = load_function(args.custom_prepare_path, "--custom-prepare-path")
        if args.custom_loss_function_path:
            loss = load_function(args.custom_loss_function_path, "--custom-loss-function-path")
        return cls(context, prepare, loss, loss is not None and _wants_logits(loss, args))


def _wants_logits(fn: Callable, args: Any) -> bool:
    """Whether a loss hook takes ``logits`` or ``scores`` (its second parameter's name)."""
    params = list(inspect.signature(fn).parameters)
    second = params[1] if len(params) > 1 else None
    if second not in ("logits", "scores"):
        raise ArgumentError(
            f"--custom-loss-function-path {args.custom_loss_function_path}: the second parameter "
            f"must be named logits or scores (got {second})"
        )
    return second == "logits"
