"""Request and reply shapes of SGLang's ``/generate`` that the trainer builds or decodes."""

from __future__ import annotations

import base64
import binascii
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass
class SamplingParams:
    """``sampling_params`` of a ``/generate`` request (SGLang's names and meanings).

    Only fields that are set (not ``None``) are sent, so the server's defaults apply to
    the rest. ``max_new_tokens`` is always sent (SGLang's default is 128).
    ``temperature`` below 1e-6 means greedy; ``top_k = -1`` means all tokens; ``n`` asks
    for that many samples of each prompt. Unknown keys are refused by SGLang with 400, so
    pass extra keys only through a plain dict.
    """

    max_new_tokens: int = 128
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    n: int | None = None
    sampling_seed: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value is not None}


def sampling_params_json(params: SamplingParams | dict[str, Any] | None) -> dict[str, Any] | None:
    """A ``SamplingParams`` as its JSON object; a dict passes through unchanged."""
    if params is None or isinstance(params, dict):
        return params
    if isinstance(params, SamplingParams):
        return params.to_json()
    raise TypeError(f"sampling_params must be SamplingParams or dict, got {type(params).__name__}")


def decode_routed_experts(data: str, num_layers: int, topk: int) -> np.ndarray:
    """Decode ``meta_info["routed_experts"]`` into an int32 array ``[tokens, num_layers, topk]``.

    SGLang sends base64 of the raw bytes of a C-ordered little-endian int32 array of that
    shape: entry ``[t, l, k]`` is the k-th expert the router of layer ``l`` chose for
    position ``routed_experts_start_len + t``. ``num_layers`` is the model's
    ``num_hidden_layers`` and ``topk`` its ``num_experts_per_tok``. Use
    ``torch.from_numpy`` for a tensor.
    """
    if num_layers <= 0 or topk <= 0:
        raise ValueError(f"num_layers and topk must be positive, got {num_layers}, {topk}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"routed_experts is not valid base64: {err}") from err
    row = 4 * num_layers * topk
    if len(raw) % row:
        raise ValueError(
            f"routed_experts has {len(raw)} bytes, not a multiple of "
            f"4 * num_layers({num_layers}) * topk({topk}) = {row}"
        )
    flat = np.frombuffer(raw, dtype="<i4").astype(np.int32, copy=True)
    return flat.reshape(-1, num_layers, topk)
