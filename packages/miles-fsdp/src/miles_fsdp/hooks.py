"""Custom prepare and loss hooks (``--custom-prepare-path``, ``--custom-loss-function-path``).

Both flags name a function as ``package.module:function`` (or ``package.module.function``).
Hooks receive a :class:`HookContext` whose ``models``, ``reference_models`` and
``teacher_models`` map component names (``--update-weight-target-module``, default
``"model"``) to the sharded modules; a role that was not built maps to nothing. Frozen roles
run in eval mode with no gradients; call them inside ``torch.no_grad()``.

* prepare: ``prepare(ctx, batch) -> RolloutBatch``, once per rollout before the old/reference
  log-probs, e.g. to attach teacher log-probs with ``batch.with_fields(...)``;
* loss: ``loss(ctx, logits | scores, packed, config, denominator) -> (contribution, parts)``
  in place of the built-in actor loss for every micro-batch; its signature, inputs and
  result are miles-core's, shared with the Megatron backend (:mod:`miles_core.custom_loss`,
  which loads, checks and calls it). On this backend a hook taking ``logits`` makes the model
  materialise the full logits (the dense path, whatever ``--fused-log-probs`` says): ``T x V``
  in the compute dtype, plus what the hook's own softmax keeps for backward (a float32
  ``T x V`` or two), the memory that caps ``--max-tokens-per-gpu``; one taking ``scores`` is
  lean under ``--fused-log-probs``.

``ctx.logits(model, packed)`` runs any role on the same packed row the actor saw (attention
kept inside each sample, the actor's attention implementation), e.g. a teacher for
distillation, and materialises its ``[1, T, V]`` logits; ``ctx.scores(model, packed,
temperature)`` gives the same role's :class:`TokenScores` through the fused head instead
(``--fused-log-probs``; the dense path otherwise).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from miles_core.args.parsed import ParsedArgs
from miles_core.custom_loss import LossHook, LossHookContext, TokenScores
from miles_core.log_prob_head import dense_log_probs
from miles_core.packing import PackedBatch, packed_attention_kwargs
from miles_core.user_functions import load_function
from torch import nn

from miles_fsdp.output_head import scoring

__all__ = ["HookContext", "Hooks", "TokenScores"]


@dataclass
class HookContext(LossHookContext):
    """What hooks see: the flags and every role's components by name, and how to run them."""

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
    loss: LossHook | None = None

    @classmethod
    def from_args(cls, args: ParsedArgs, context: HookContext) -> Hooks:
        prepare = None
        if args.custom_prepare_path:
            prepare = load_function(args.custom_prepare_path, "--custom-prepare-path")
        return cls(context, prepare, LossHook.from_args(args))
