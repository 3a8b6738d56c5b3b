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
        """Parse ``sampling_params`` of a /generate body; unknown keys raise (SGLang: 400)."""
        raw = dict(raw or {})
        known = {f.name for f in fields(cls)}
        kwargs = {}
        for key, value in raw.items():
            if key in known:
                if value is not None:
                    kwargs[key] = value
            elif key in _UNSUPPORTED_AT_DEFAULT:
                if value not in (_UNSUPPORTED_AT_DEFAULT[key], None):
                    raise SamplingParamsError(
                        f"sampling_params.{key}={value!r} is not supported by the built-in engine"
                    )
            elif key not in _IGNORED:
                raise SamplingParamsError(f"unknown sampling_params key: {key!r}")
        params = cls(**kwargs)
        if isinstance(params.stop, str):
            params.stop = [params.stop]
        params.stop = [s for s in params.stop if s]
        params.stop_token_ids = [int(t) for t in params.stop_token_ids]
        params.validate()
        return params

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise SamplingParamsError(
                f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}"
            )
        if self.temperature < 0:
            raise SamplingParamsError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise SamplingParamsError(f"top_k must be -1 (all) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.n, int) or self.n < 1:
            raise SamplingParamsError(f"n must be an integer >= 1, got {self.n!r}")


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
