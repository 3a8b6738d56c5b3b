"""The ``--custom-loss-function-path`` hook: loaded, checked and called here for both backends.

The flag names ``package.module:function`` (or ``package.module.function``)::

    loss(ctx, logits_or_scores, packed, config, denominator) -> (contribution, parts)

It replaces the actor's built-in loss (``--loss-type policy_loss``) for every micro-batch:

* ``ctx``: a :class:`LossHookContext` (``args``, ``device`` and the role maps ``models``,
  ``reference_models``, ``teacher_models``: component name -> module). The FSDP backend passes
  its ``miles_fsdp.hooks.HookContext``, which fills the maps and adds ``ctx.logits(model,
  packed)`` / ``ctx.scores(model, packed, temperature)`` to run a role (e.g. a teacher) on the
  same row; the Megatron backend's maps are empty (it builds no teacher, and a module cannot
  be run from inside megatron's schedule).
* the second parameter, chosen by its *name*: ``logits`` gets the ``[1, T, V]`` logits of the
  packed row (materialised for it: the dense path; the vocabulary gathered over TP on
  Megatron); ``scores`` gets a :class:`TokenScores` of the target tokens' log-probs and
  entropies ``[1, T]`` (float32, at ``config.temperature``, with gradients) from the backend's
  own log-prob head (fused under ``--fused-log-probs``). Another name is refused on loading.
* ``packed``: the micro-batch's :class:`~miles_core.packing.PackedBatch` (``targets``,
  ``loss_mask``, ``sample_ids``, ``cu_seqlens``, ``sample_loss_tokens``; its ``fields`` hold
  ``advantages``, ``old_log_probs``, ``ref_log_probs`` when the run computes them, and a
  prepare hook's fields).
* ``config``: the step's :class:`~miles_core.losses.LossConfig`; ``denominator``: the step's
  global loss denominator (docs/rl-math.md), the same for every micro-batch and rank.

``contribution`` is a 0-d floating tensor with a gradient: this micro-batch's share of the
step loss (divide the sum of its terms by ``denominator`` so shares add up over micro-batches
and ranks); the backend back-propagates it exactly as it does the built-in loss. ``parts`` maps
names to scalars (tensors or numbers) logged like the built-in loss's parts (summed over the
micro-batches and data-parallel ranks, extremes by name: :mod:`miles_core.metric_reduction`);
the contribution itself is logged as ``loss`` (a part of that name is refused).
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from miles_core.args import ArgumentError
from miles_core.args.parsed import ParsedArgs
from miles_core.user_functions import load_function

FLAG = "--custom-loss-function-path"


@dataclass
class TokenScores:
    """Per-position log-prob of the target token and entropy, ``[1, T]`` float32."""

    log_probs: torch.Tensor
    entropy: torch.Tensor


@dataclass
class LossHookContext:
    """What a loss hook sees of the run: the flags, the device and the roles by component."""

    args: ParsedArgs
    device: torch.device
    models: dict[str, torch.nn.Module] = field(default_factory=dict)
    reference_models: dict[str, torch.nn.Module] = field(default_factory=dict)
    teacher_models: dict[str, torch.nn.Module] = field(default_factory=dict)


@dataclass(frozen=True)
class LossHook:
    """A loaded loss hook; call it with the backend's outputs to get the checked result."""

    fn: Callable
    spec: str
    #: its second parameter is ``logits`` (else ``scores``)
    wants_logits: bool

    @classmethod
    def from_args(cls, args: ParsedArgs) -> LossHook | None:
        """The hook ``--custom-loss-function-path`` names, or None when the flag is unset; a bad
        spec or a second parameter named neither ``logits`` nor ``scores`` is an
        :class:`ArgumentError` naming the flag."""
        spec = args.custom_loss_function_path
        if not spec:
            return None
        fn = load_function(spec, FLAG)
        params = list(inspect.signature(fn).parameters)
        second = params[1] if len(params) > 1 else None
        if second not in ("logits", "scores"):
            raise ArgumentError(
                f"{FLAG} {spec}: the second parameter must be named logits or scores (got {second})"
            )
        return cls(fn, spec, second == "logits")

    def __call__(
        self,
        ctx: LossHookContext,
        outputs: torch.Tensor | TokenScores,
        packed: Any,
        config: Any,
        denominator: float,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(contribution, parts)`` of the hook on one micro-batch, parts as 0-d tensors."""
        result = self.fn(ctx, outputs, packed, config, denominator)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(
                f"{FLAG} {self.spec}: returned {_kind(result)}, expected a pair "
                "(contribution, parts)"
            )
        contribution, parts = result
        if not (
            isinstance(contribution, torch.Tensor)
            and contribution.dim() == 0
            and contribution.is_floating_point()
        ):
            raise TypeError(
                f"{FLAG} {self.spec}: the contribution is {_kind(contribution)}, "
                "expected a 0-d floating tensor"
            )
        if torch.is_grad_enabled() and not contribution.requires_grad:
            raise ValueError(
                f"{FLAG} {self.spec}: the contribution carries no gradient (is it "
                "computed from the logits or scores it was given?)"
            )
        if not isinstance(parts, dict):
            raise TypeError(f"{FLAG} {self.spec}: parts is {_kind(parts)}, expected a dict")
        if "loss" in parts:
            raise ValueError(
                f"{FLAG} {self.spec}: a part named 'loss' would hide the "
                "contribution, logged under that name; rename it"
            )
        checked = {name: _scalar(self.spec, name, v, contribution) for name, v in parts.items()}
        return contribution, {"loss": contribution.detach().float(), **checked}


def _scalar(spec: str, name: Any, value: Any, like: torch.Tensor) -> torch.Tensor:
    if isinstance(value, numbers.Real):
        value = torch.tensor(float(value), device=like.device)
    if not isinstance(name, str) or not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise TypeError(
            f"{FLAG} {spec}: part {name!r} is {_kind(value)}, expected a scalar under a str name"
        )
    return value.detach().float().reshape(())


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"
