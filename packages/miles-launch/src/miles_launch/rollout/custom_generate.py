"""Custom generation (``--custom-generate-function-path``): multi-turn and agentic rollouts.

The function replaces the one ``/generate`` request of a sample::

    async def generate(ctx: GenerateContext, prompt: Prompt, sampling_params: dict)
        -> CustomSample | list[CustomSample]

``ctx.client`` is the engine (or router) client chosen for the sample, ``ctx.url`` its URL,
``ctx.tokenizer`` the run's tokenizer; ``sampling_params`` are the rollout's (temperature,
top-p/k, ``max_new_tokens``, stops, the sample's ``sampling_seed``). The function drives the
conversation itself (:func:`engine_turn` runs one model turn and parses the reply) and returns
the sample's response: every token after the prompt (model turns and tool or environment
output alike), a rollout log-prob per token and a ``loss_mask`` with 0 on the tokens the model
did not generate, so they are not trained on. A returned ``reward`` is used as is; without
one the run's reward function scores the sample. Several samples returned by one call all
join the prompt's group (GRPO groups may be uneven).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from miles_core.user_functions import load_function

FLAG = "--custom-generate-function-path"


@dataclass(frozen=True)
class GenerateContext:
    """What a custom generate function gets besides the prompt and the sampling params."""

    client: Any  # AsyncEngineClient: await client.generate(input_ids=..., ...)
    url: str
    tokenizer: Any
    sample_index: int  # which of the prompt's --n-samples-per-prompt calls this is


@dataclass
class CustomSample:
    """One sample's response as a custom generate function returns it."""

    response_ids: list[int]
    rollout_log_probs: list[float]  # one per response token (any value where loss_mask is 0)
    loss_mask: list[int] | None = None  # 1: trained on, 0: tool/environment token; None: all 1
    response_text: str = ""
    finish_reason: str = "stop"
    reward: float | None = None  # None: scored by the run's reward function
    weight_version: int | None = None


@dataclass(frozen=True)
class Turn:
    """One ``/generate`` reply, parsed."""

    ids: list[int]
    log_probs: list[float]
    text: str
    finish_reason: str
    finish_matched: Any  # the stop string or token id that ended it, else None
    weight_version: int | None


def parse_reply(reply: dict[str, Any]) -> Turn:
    """A ``/generate`` reply (with ``return_logprob``) as a :class:`Turn`."""
    meta = reply["meta_info"]
    finish = meta.get("finish_reason") or {}
    try:
        version = int(meta.get("weight_version"))
    except (TypeError, ValueError):
        version = None
    return Turn(
        ids=[int(entry[1]) for entry in meta["output_token_logprobs"]],
        log_probs=[float(entry[0]) for entry in meta["output_token_logprobs"]],
        text=reply.get("text", ""),
        finish_reason=str(finish.get("type", "")),
        finish_matched=finish.get("matched"),
        weight_version=version,
    )


async def engine_turn(ctx: GenerateContext, input_ids: list[int], sampling_params: dict) -> Turn:
    """One model turn on ``ctx.client``: ``input_ids`` continued under ``sampling_params``."""
    reply = await ctx.client.generate(
        input_ids=list(input_ids),
        sampling_params=sampling_params,
        return_logprob=True,
        return_routed_experts=False,
    )
    return parse_reply(reply)


GenerateFunction = Callable[[GenerateContext, Any, dict], Awaitable[Any]]


def load_generate_function(path: str) -> GenerateFunction:
    """Import ``MODULE:FUNCTION`` or ``MODULE.FUNCTION``; it must be ``async``."""
    return load_function(path, FLAG, coroutine=True)


def checked_samples(value: Any, where: str) -> list[CustomSample]:
    """The function's return value as a non-empty list of well-formed samples."""
    samples = value if isinstance(value, list) else [value]
    if not samples:
        raise ValueError(f"{where} returned no sample")
    for i, s in enumerate(samples):
        name = f"{where}, sample {i}"
        if not isinstance(s, CustomSample):
            raise ValueError(f"{name}: expected a CustomSample, got {type(s).__name__}")
        n = len(s.response_ids)
        if n == 0:
            raise ValueError(f"{name}: empty response_ids")
        if len(s.rollout_log_probs) != n:
            raise ValueError(
                f"{name}: {len(s.rollout_log_probs)} rollout_log_probs for {n} response tokens"
            )
        if s.loss_mask is not None:
            if len(s.loss_mask) != n:
                raise ValueError(f"{name}: loss_mask has {len(s.loss_mask)} entries for {n} tokens")
            if any(m not in (0, 1) for m in s.loss_mask):
                raise ValueError(f"{name}: loss_mask must hold only 0 and 1")
        if s.reward is not None and not math.isfinite(float(s.reward)):
            raise ValueError(f"{name}: reward {s.reward}")
    return samples
