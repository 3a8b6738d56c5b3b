"""/generate input parsing and reply formatting (SGLang's shapes)."""

from __future__ import annotations

import base64

import torch

from miles_launch.builtin_engine.scheduler import Request


class GenerateInputError(ValueError):
    """A /generate body SGLang would reject (answered with 400)."""


def parse_prompts(body: dict, tokenizer) -> tuple[list[list[int]], bool]:
    """Token ids of each prompt, and whether the request was a single prompt."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise GenerateInputError("generate: give exactly one of text or input_ids")
    if text is not None:
        texts = text if isinstance(text, list) else [text]
        if not all(isinstance(t, str) for t in texts):
            raise GenerateInputError("generate: text must be a string or a list of strings")
        return [tokenizer.encode(t) for t in texts], not isinstance(text, list)
    if not isinstance(input_ids, list):
        raise GenerateInputError("generate: input_ids must be a list of ints or of lists of ints")
    single = not (input_ids and isinstance(input_ids[0], list))
    batch = [input_ids] if single else input_ids
    if not all(isinstance(ids, list) and all(type(t) is int for t in ids) for ids in batch):
        raise GenerateInputError(
            "generate: input_ids must be a list of ints or a list of lists of ints"
        )
    return batch, single


#: Most sequences (prompts x n) one /generate call may ask for.
MAX_SEQUENCES_PER_REQUEST = 4096


def check_admission(
    prompts: list[list[int]], params: list, vocab_size: int, context_length: int
) -> None:
    """Refuse (400, naming the field) what would fail inside the model: a token id outside
    ``[0, vocab_size)`` (on CUDA an out-of-range embedding index is a device assert that
    kills the process), a prompt, or prompt plus ``max_new_tokens``, that does not fit the
    context (SGLang's rule: both must stay below ``context_length``), or more sequences than
    :data:`MAX_SEQUENCES_PER_REQUEST`."""
    total = sum(p.n for p in params)
    if total > MAX_SEQUENCES_PER_REQUEST:
        raise GenerateInputError(
            f"generate: {total} sequences (prompts x sampling_params.n) exceed the built-in "
            f"engine's {MAX_SEQUENCES_PER_REQUEST} per request"
        )
    for i, (ids, p) in enumerate(zip(prompts, params)):
        where = "input_ids" if len(prompts) == 1 else f"input_ids[{i}]"
        for j, token in enumerate(ids):
            if not 0 <= token < vocab_size:
                raise GenerateInputError(
                    f"generate: {where}[{j}] = {token} is outside the vocabulary [0, {vocab_size})"
                )
        if len(ids) >= context_length:
            raise GenerateInputError(
                f"generate: {where}: the input ({len(ids)} tokens) is longer than the model's "
                f"context length ({context_length} tokens)"
            )
        if len(ids) + p.max_new_tokens >= context_length:
            raise GenerateInputError(
                f"generate: sampling_params.max_new_tokens {p.max_new_tokens} with a {len(ids)}-"
                f"token input exceeds the model's context length ({context_length} tokens)"
            )
        for token in p.stop_token_ids:
            if not 0 <= token < vocab_size:
                raise GenerateInputError(
                    f"generate: sampling_params.stop_token_ids: {token} is outside the "
                    f"vocabulary [0, {vocab_size})"
                )


def format_reply(req: Request, weight_version: str, latency: float, routed_start: int) -> dict:
    meta = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": 0,
        "weight_version": weight_version,
        "e2e_latency": latency,
    }
    if req.return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tok, None] for lp, tok in zip(req.output_logprobs, req.output_ids)
        ]
    if req.return_routed_experts and req.routed:
        routed = (
            torch.stack(req.routed[routed_start:])
            if len(req.routed) > routed_start
            else torch.empty(0)
        )
        meta["routed_experts"] = base64.b64encode(routed.contiguous().numpy().tobytes()).decode()
    return {"text": req.text, "output_ids": list(req.output_ids), "meta_info": meta}
