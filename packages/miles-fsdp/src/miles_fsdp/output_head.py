"""The HF model's output head as miles-core's fused log-prob head (``--fused-log-probs``).

While :func:`scoring` is active, the model's output projection (``get_output_embeddings()``:
``lm_head``, which is the input embedding's module when the embeddings are tied) returns
``[..., 2]`` = (log-prob of the target, entropy) per position from
:func:`miles_core.log_prob_head.fused_log_probs` instead of ``[..., V]`` logits; the model's
forward is otherwise untouched, so ``model(...).logits`` carries the two columns. The head runs
inside the projection module's own call, where FSDP2 has unsharded its weight; the weight is
saved for backward like ``nn.Linear`` saves it, and FSDP2's pre-backward hook on the model's
output re-gathers it before the head's backward reads it.

LoRA on the head (PEFT ``lora.Linear``, ``--lora-target-modules lm_head``): its output
``x W^T + s (dropout(x) A^T) B^T`` is one projection of the concatenated operands
``[x, s dropout(x) A^T] @ [W, B]^T``, so the fused head takes those (an extra ``[V, H + r]``
copy of the weight, never ``[T, V]``) and autograd carries the gradients to ``x``, ``A`` and
``B``.

Models whose forward changes the logits after the head (``final_logit_softcapping``,
``logit_scale``) are refused by :func:`check_fused_head` at start-up: run those with
``--no-fused-log-probs``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from miles_core.log_prob_head import fused_log_probs
from torch import nn

#: Config fields of models whose forward rescales the head's logits.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")


def check_fused_head(config: Any) -> None:
    """Refuse, naming the flag, a model whose logits are transformed after the head."""
    for cfg in (config, getattr(config, "text_config", None)):
        for name in _LOGIT_TRANSFORMS:
            if cfg is not None and getattr(cfg, name, None) not in (None, 1.0):
                raise ValueError(
                    f"{config.model_type}: {name} transforms the logits after the output head; "
                    "the fused log-prob head does not apply it (pass --no-fused-log-probs)"
                )


def head_operands(head: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden, weight)`` with ``head(x) == hidden @ weight.T`` (LoRA folded in as extra
    columns)."""
    base = getattr(head, "base_layer", None)
    linear = base if base is not None else head
    if getattr(linear, "bias", None) is not None:
        raise ValueError("the fused log-prob head needs a bias-free output projection")
    weight = linear.weight
    if base is None or head.disable_adapters or head.merged:
        return x, weight
    hidden, weights = [x], [weight]
    for name in head.active_adapters:
        if name not in head.lora_A:
            continue
        if name in getattr(head, "lora_variant", {}):
            raise ValueError(f"LoRA variant of adapter {name} on the output head is not supported")
        lora_a, lora_b = head.lora_A[name], head.lora_B[name]
        xa = lora_a(head.lora_dropout[name](x.to(lora_a.weight.dtype))) * head.scaling[name]
        hidden.append(xa.to(x.dtype))
        weights.append(lora_b.weight.to(weight.dtype))
    if len(hidden) == 1:
        return x, weight
    return torch.cat(hidden, dim=-1), torch.cat(weights, dim=1)


@contextlib.contextmanager
def scoring(
    model: nn.Module, targets: torch.Tensor, temperature: float, entropy_grad: bool = True
) -> Iterator[None]:
    """Within: ``model``'s output head returns ``[..., 2]`` (log-prob of ``targets``, entropy)
    at ``temperature``, float32; the entropy carries a gradient only with ``entropy_grad``."""
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings to fuse")

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        hidden, weight = head_operands(head, x)
        lp, ent = fused_log_probs(
            hidden, weight, targets.expand(x.shape[:-1]), temperature, entropy_grad=entropy_grad
        )
        return torch.stack([lp, ent], dim=-1)

    own = head.__dict__.get("forward")  # an instance-level forward installed by someone else
    head.forward = forward
    try:
        yield
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own
