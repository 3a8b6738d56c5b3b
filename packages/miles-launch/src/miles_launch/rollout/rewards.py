"""Rewards: the built-ins of ``--rm-type`` and ``--custom-rm-path MODULE:FUNCTION``.

A reward function takes a :class:`RewardInput` and returns a float; it may be ``async``.

* ``math``: 1.0 when the response's final answer equals the label, else 0.0. The final answer
  is the content of the last ``\\boxed{...}``, else the last number in the response; both
  sides are compared after stripping spaces, a trailing period and ``$``, and numerically
  when both parse as numbers.
* ``label-char-fraction`` (the demo's): the number of response characters that occur in the
  label, divided by ``--rollout-max-response-len``, so it lies in [0, 1] and rewards long
  responses made only of the label's characters.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RewardInput:
    """What a reward function sees of one sample."""

    prompt: str
    response: str
    label: Any
    response_ids: tuple[int, ...]
    finish_reason: str
    max_response_len: int
    metadata: dict = field(default_factory=dict)


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def final_answer(text: str) -> str | None:
    """The last ``\\boxed{}`` content, else the last number, else None."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text.replace(",", ""))
    return numbers[-1] if numbers else None


def _normalize(answer: str) -> str:
    return answer.strip().strip("$").rstrip(".").replace(" ", "").replace(",", "")


def _as_number(answer: str) -> float | None:
    try:
        if "/" in answer:
            num, den = answer.split("/", 1)
            return float(num) / float(den)
        return float(answer)
    except (ValueError, ZeroDivisionError):
        return None


def math_reward(inp: RewardInput) -> float:
    """``--rm-type math`` (see the module docstring)."""
    if inp.label is None:
        raise ValueError("--rm-type math needs a label (--label-key) for every prompt")
    answer = final_answer(inp.response)
    if answer is None:
        return 0.0
    got, want = _normalize(answer), _normalize(str(inp.label))
    if got == want:
        return 1.0
    a, b = _as_number(got), _as_number(want)
    return 1.0 if a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9) else 0.0


def label_char_fraction(inp: RewardInput) -> float:
    """``--rm-type label-char-fraction`` (see the module docstring)."""
    if not inp.label:
        raise ValueError("--rm-type label-char-fraction needs a non-empty string label")
    allowed = set(str(inp.label))
    hits = sum(1 for ch in inp.response[: inp.max_response_len] if ch in allowed)
    return hits / inp.max_response_len


BUILTIN_REWARDS: dict[str, Callable[[RewardInput], float]] = {
    "math": math_reward,
    "label-char-fraction": label_char_fraction,
}


def load_custom(path: str) -> Callable[[RewardInput], Any]:
    """Import ``MODULE:FUNCTION`` (errors name ``--custom-rm-path``)."""
    module_name, _, func_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"--custom-rm-path {path}: cannot import {module_name}: {error}") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ValueError(f"--custom-rm-path {path}: {module_name} has no function {func_name}")
    return func


class RewardModel:
    """The run's reward function (built-in or custom), awaited uniformly."""

    def __init__(self, rm_type: str | None, custom_rm_path: str | None):
        if custom_rm_path:
            self.func = load_custom(custom_rm_path)
            self.name = custom_rm_path
        elif rm_type:
            self.func = BUILTIN_REWARDS[rm_type]
            self.name = rm_type
        else:
            raise ValueError("no reward: set --rm-type or --custom-rm-path")

    async def __call__(self, inp: RewardInput) -> float:
        value = self.func(inp)
        if inspect.isawaitable(value):
            value = await value
        try:
            reward = float(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"reward function {self.name} returned {value!r}, not a number"
            ) from None
        if not math.isfinite(reward):
            raise ValueError(f"reward function {self.name} returned {reward}")
        return reward
