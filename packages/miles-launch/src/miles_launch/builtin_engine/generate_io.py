"""/generate input parsing and reply formatting (SGLang's shapes)."""

from __future__ import annotations

import base64
import uuid

import torch

from miles_launch.builtin_engine.request import Request


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
    if not input_ids:  # SGLang's GenerateReqInput refuses it with these words
        raise GenerateInputError("input_ids cannot be empty.")
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
    context (SGLang's rule: the input must be shorter than ``context_length``, input plus
    ``max_new_tokens`` at most ``context_length``), or more sequences than
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
        if len(ids) + p.max_new_tokens > context_length:
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


def request_ids(body: dict, count: int, single: bool) -> list[str]:
    """One rid per prompt: the given list, or the given (or a fresh) rid, suffixed ``-i`` for a
    batch."""
    rid = body.get("rid") or uuid.uuid4().hex
    if not (
        isinstance(rid, str) or (isinstance(rid, list) and all(isinstance(r, str) for r in rid))
    ):
        raise GenerateInputError(
            f"generate: rid must be a string or a list of strings, got {rid!r}"
        )
    rids = rid if isinstance(rid, list) else [rid if single else f"{rid}-{i}" for i in range(count)]
    if len(rids) != count:
        raise GenerateInputError(f"rid: {len(rids)} ids for {count} prompts")
    return rids


def logprob_start_len(body: dict, prompts: list[list[int]], params: list) -> int:
    """``logprob_start_len`` (SGLang's: -1, the default, = output log-probs only; ``s >= 0``
    also returns ``meta_info.input_token_logprobs`` for input tokens ``s ..``, the first entry's
    log-prob ``None``). One int for every prompt, below each prompt's length; with
    ``max_new_tokens`` 0 it is refused (the built-in engine runs no forward pass then)."""
    start = body.get("logprob_start_len")
    if start is None or start == -1:
        return -1
    if type(start) is not int or start < 0:
        raise GenerateInputError(
            f"generate: logprob_start_len must be -1 or an int >= 0, got {start!r}"
        )
    for i, ids in enumerate(prompts):
        if start >= len(ids):
            raise GenerateInputError(
                f"generate: logprob_start_len {start} is not below the length of input {i} "
                f"({len(ids)} tokens)"
            )
    if body.get("return_logprob") and any(p.max_new_tokens == 0 for p in params):
        raise GenerateInputError(
            "generate: logprob_start_len with max_new_tokens 0 is not supported by the built-in "
            "engine"
        )
    return start


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
        if req.logprob_start_len >= 0:  # empty when the request ended before its prefill
            inputs = req.prompt_ids[req.logprob_start_len :]
            meta["input_token_logprobs"] = [
                [lp, tok, None] for lp, tok in zip(req.input_logprobs or [], inputs)
            ]
    if req.return_routed_experts and req.routed:
        routed = (
            torch.stack(req.routed[routed_start:])
            if len(req.routed) > routed_start
            else torch.empty(0)
        )
        meta["routed_experts"] = base64.b64encode(routed.contiguous().numpy().tobytes()).decode()
    return {"text": req.text, "output_ids": list(req.output_ids), "meta_info": meta}
