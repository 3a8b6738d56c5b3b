"""One sequence the built-in engine generates, and what its prefill and its end need to know
(the input log-probs SGLang returns, the model's end-of-sequence ids)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from miles_launch.builtin_engine.sampling import SamplingParams


@dataclass
class Request:
    """One sequence to generate (a /generate call with ``n > 1`` or a batch makes several)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    on_done: Callable[[Request], None]
    return_logprob: bool = False
    return_routed_experts: bool = False
    # SGLang's logprob_start_len: -1, or the first input position of ``input_logprobs``
    logprob_start_len: int = -1
    # log-probs of input tokens logprob_start_len.. (the first None), set by the prefill
    input_logprobs: list[float | None] | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: dict | None = None
    text: str = ""
    # Per fed position: int32 [num_layers, top_k] expert ids (routed experts capture).
    routed: list[torch.Tensor] = field(default_factory=list)
    generator: torch.Generator | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def input_logprobs(logits: torch.Tensor, prompt_ids: list[int], start: int) -> list:
    """SGLang's ``input_token_logprobs`` values from one row's prefill ``logits`` ``[seq, vocab]``
    (its real positions): ``None`` for input token ``start``, then the log-prob of each later
    input token given everything before it. Not temperature-scaled (SGLang scales only the
    output tokens' log-probs)."""
    n = len(prompt_ids)
    logprobs = torch.log_softmax(logits[start : n - 1].float(), dim=-1)
    targets = torch.tensor(prompt_ids[start + 1 : n], device=logits.device)
    return [None, *logprobs.gather(1, targets[:, None])[:, 0].tolist()]


def eos_ids(model: torch.nn.Module, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
