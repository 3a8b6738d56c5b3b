"""float64 references of the tiny models: the HF model itself, on the CPU, eager attention."""

from __future__ import annotations

import torch
from torch import nn


def dense_model(hf_dir, state=None, adapter_dir=None) -> nn.Module:
    """``from_pretrained`` in float64; ``state``: weights to load over it (strict);
    ``adapter_dir``: a PEFT adapter merged in (``merge_and_unload``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(hf_dir), dtype=torch.float64, attn_implementation="eager"
    )
    if state is not None:
        model.load_state_dict({n: v.double() for n, v in state.items()}, strict=True)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    return model


def dense_logits(model_or_dir, data: torch.Tensor, adapter_dir=None) -> torch.Tensor:
    """Logits ``[B, T, V]`` (float64) of ``data`` under a model or an HF directory."""
    model = model_or_dir
    if not isinstance(model, nn.Module):
        model = dense_model(model_or_dir, adapter_dir=adapter_dir)
    with torch.no_grad():
        return model.double()(input_ids=data, use_cache=False).logits


def response_log_probs(model: nn.Module, sample, temperature: float = 1.0) -> torch.Tensor:
    """float64 log-probs of ``sample``'s response tokens at ``temperature`` (one sequence);
    differentiable (call under ``torch.no_grad()`` when no gradient is wanted)."""
    tokens = sample.tokens[None]
    logits = model(input_ids=tokens, use_cache=False).logits[0, :-1]
    lp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return lp.gather(-1, tokens[0, 1:, None]).squeeze(-1)[-sample.response_length :]
