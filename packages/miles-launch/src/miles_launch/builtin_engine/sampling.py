"""Sampling parameters and next-token selection with SGLang's semantics.

For one request with logits ``z`` (one row, float32):

* ``temperature < 1e-6``: greedy, ``argmax z`` (``logprob`` then uses ``T = 1``);
* otherwise ``p = softmax(z / T)``, then keep only the ``top_k`` most likely tokens
  (``-1`` = all), then the smallest set of most likely tokens whose mass reaches ``top_p``,
  then tokens with ``p >= min_p * max(p)``; renormalise and draw one token from the
  request's generator (seeded by ``sampling_seed`` when given).
* The reported logprob of the chosen token is ``log_softmax(z / T)`` (``T = 1`` for greedy),
  i.e. temperature-scaled but before top-k/top-p/min-p truncation.

Finish reasons (``meta_info.finish_reason``): ``{"type": "stop", "matched": <token id or
stop string>}``, ``{"type": "length", "length": max_new_tokens}``, ``{"type": "abort",
"message": ...}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch

GREEDY_TEMPERATURE = 1e-6

# Keys SGLang's SamplingParams knows that the built-in engine accepts only at these values.
_UNSUPPORTED_AT_DEFAULT = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "logit_bias": None,
    "custom_params": None,
    "beam_width": None,
    "watermark": None,
}
_IGNORED = {"spaces_between_special_tokens", "stream_interval"}


class SamplingParamsError(ValueError):
    """A sampling parameter is unknown or out of range (answered with 400)."""


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @classmethod
    def from_request(cls, raw: dict | None) -> SamplingParams:
        """Parse ``sampling_params`` of a /generate body; an unknown key, a wrong type or a
        value outside SGLang's domain raises :class:`SamplingParamsError` naming it (400)."""
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise SamplingParamsError(
                f"sampling_params must be an object, got {type(raw).__name__}"
            )
        known = {f.name for f in fields(cls)}
        kwargs = {}
        for key, value in raw.items():
            if key in known:
                if value is not None:
                    kwargs[key] = value
            elif key in _UNSUPPORTED_AT_DEFAULT:
                if value is not None and not _equal_default(value, _UNSUPPORTED_AT_DEFAULT[key]):
                    raise SamplingParamsError(
                        f"sampling_params.{key}={value!r} is not supported by the built-in engine"
                    )
            elif key not in _IGNORED:
                raise SamplingParamsError(f"unknown sampling_params key: {key!r}")
        _check_types(kwargs)
        params = cls(**kwargs)
        if isinstance(params.stop, str):
            params.stop = [params.stop]
        params.stop = [s for s in params.stop if s]
        params.stop_token_ids = list(params.stop_token_ids)
        params.validate()
        return params

    def validate(self) -> None:
        """SGLang's domains (``SamplingParams.verify``)."""
        if self.max_new_tokens < 0:
            raise SamplingParamsError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise SamplingParamsError(
                f"min_new_tokens must be in [0, max_new_tokens ({self.max_new_tokens})], "
                f"got {self.min_new_tokens}"
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingParamsError(
                f"temperature must be a non-negative finite number, got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise SamplingParamsError(f"top_k must be -1 (all) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.n < 1:
            raise SamplingParamsError(f"n must be >= 1, got {self.n}")


#: The JSON type each field takes (``bool`` is not an int here, an int is a float).
_FIELD_TYPES = {
    "max_new_tokens": int,
    "min_new_tokens": int,
    "top_k": int,
    "n": int,
    "sampling_seed": int,
    "temperature": float,
    "top_p": float,
    "min_p": float,
    "ignore_eos": bool,
    "skip_special_tokens": bool,
    "no_stop_trim": bool,
}


def _is(value, kind) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_types(kwargs: dict) -> None:
    names = {int: "an int", float: "a number", bool: "a bool"}
    for key, kind in _FIELD_TYPES.items():
        if key in kwargs and not _is(kwargs[key], kind):
            raise SamplingParamsError(
                f"sampling_params.{key} must be {names[kind]}, got {kwargs[key]!r}"
            )
    stop = kwargs.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise SamplingParamsError("sampling_params.stop must be a string or a list of strings")
    ids = kwargs.get("stop_token_ids")
    if ids is not None and not (isinstance(ids, list) and all(_is(t, int) for t in ids)):
        raise SamplingParamsError("sampling_params.stop_token_ids must be a list of ints")
    seed = kwargs.get("sampling_seed")
    if seed is not None and not 0 <= seed < 2**63:
        raise SamplingParamsError(
            f"sampling_params.sampling_seed must be in [0, 2**63), got {seed}"
        )


def _equal_default(value, default) -> bool:
    try:
        return bool(value == default)
    except Exception:
        return False


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.sampling_seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(int(params.sampling_seed))
    return gen


def choose_token(
    logprobs: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    banned: list[int] | None = None,
) -> tuple[int, float]:
    """Pick the next token from one row ``logprobs = log_softmax(z / T)`` (``T = 1`` when
    greedy); return ``(token_id, logprob)``. ``banned`` ids (``min_new_tokens``) cannot be
    chosen; the reported logprob is still that of the untruncated distribution."""
    scores = logprobs
    if banned:
        scores = logprobs.clone()
        scores[banned] = float("-inf")
    if params.greedy:
        token = int(torch.argmax(scores))
        return token, float(logprobs[token])
    probs = scores.exp()
    if params.top_k != -1 and params.top_k < probs.numel():
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = mass_before > params.top_p * sorted_probs.sum()
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    if params.min_p > 0.0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, torch.zeros_like(probs))
    token = int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
    return token, float(logprobs[token])


def find_stop_string(text: str, stops: list[str]) -> tuple[str, int] | None:
    """The earliest stop string in ``text`` and where it starts, or None."""
    best = None
    for stop in stops:
        pos = text.find(stop)
        if pos != -1 and (best is None or pos < best[1]):
            best = (stop, pos)
    return best


def stop_reason(matched) -> dict:
    return {"type": "stop", "matched": matched}


def length_reason(length: int) -> dict:
    return {"type": "length", "length": length}


def abort_reason(message: str) -> dict:
    return {"type": "abort", "message": message}
