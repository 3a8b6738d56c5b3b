"""Rewards: the built-ins of ``--rm-type``, ``--custom-rm-path MODULE:FUNCTION`` and a remote
reward server (``--rm-url``, see :mod:`miles_launch.rollout.remote_reward`).

A reward function takes a :class:`RewardInput` and returns a number, or a dict from which
``--reward-key`` picks the number; it may be ``async``. With ``--custom-rm-batch group`` it
takes the list of a prompt group's inputs instead (``rollout``: every input of a generation
batch, i.e. a rollout's prompts, each draw under ``--dynamic-filter``, or an eval set) and
returns one value per input, in order.

* ``math``: 1.0 when the response's final answer equals the label, else 0.0. The final answer
  is the content of the last ``\\boxed{...}``, else the last number in the response; both
  sides are compared after stripping spaces, a trailing period and ``$``, and numerically
  when both parse as numbers.
* ``label-char-fraction`` (the demo's): the number of response characters that occur in the
  label, divided by ``--rollout-max-response-len``, so it lies in [0, 1] and rewards long
  responses made only of the label's characters.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from miles_core.args.parsed import ParsedArgs
from miles_core.user_functions import load_function

BATCH_MODES = ("sample", "group", "rollout")


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
    prompt_index: int = -1  # the prompt's index in its file (names the sample in errors)
    sample_index: int = 0  # which of the prompt's samples

    def describe(self) -> str:
        return f"sample {self.sample_index} of prompt {self.prompt_index}"


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
    """Import ``MODULE:FUNCTION`` or ``MODULE.FUNCTION`` (errors name ``--custom-rm-path``)."""
    return load_function(path, "--custom-rm-path")


def _reward_from_generate(path: str) -> Callable[[RewardInput], Any]:
    """The reward of a run whose custom generate function gives every reward: none."""

    def missing(inp: RewardInput) -> float:
        raise ValueError(
            f"--custom-generate-function-path {path} returned {inp.describe()} without a "
            "reward, and no --rm-type, --custom-rm-path or --rm-url is set"
        )

    return missing


class RewardModel:
    """The run's reward function (built-in, custom or remote), awaited uniformly.

    ``batch`` is how the function is called: once per sample (``await model(inp)``), or once
    per list of inputs (``await model.score(inputs)``, ``group`` and ``rollout``).
    """

    def __init__(
        self,
        func: Callable[[Any], Any],
        name: str,
        *,
        batch: Literal["sample", "group", "rollout"] = "sample",
        reward_key: str | None = None,
    ):
        if batch not in BATCH_MODES:
            raise ValueError(f"--custom-rm-batch {batch!r}: expected one of {BATCH_MODES}")
        self.func = func
        self.name = name
        self.batch = batch
        self.reward_key = reward_key

    @classmethod
    def from_args(cls, args: ParsedArgs) -> RewardModel:
        """The reward of ``--rm-url``, ``--custom-rm-path`` or ``--rm-type``."""
        if args.rm_url:
            # cycle: miles_launch.rollout.remote_reward imports this module
            from miles_launch.rollout.remote_reward import RemoteReward

            func: Callable[[Any], Any] = RemoteReward(
                args.rm_url, timeout_s=args.rm_timeout, max_retries=args.rm_max_retries
            )
            name = f"--rm-url {args.rm_url}"
        elif args.custom_rm_path:
            func, name = load_custom(args.custom_rm_path), args.custom_rm_path
        elif args.rm_type:
            func, name = BUILTIN_REWARDS[args.rm_type], args.rm_type
        elif args.custom_generate_function_path:
            func, name = _reward_from_generate(args.custom_generate_function_path), "none"
        else:
            raise ValueError("no reward: set --rm-type, --custom-rm-path or --rm-url")
        return cls(func, name, batch=args.custom_rm_batch, reward_key=args.reward_key)

    async def __call__(self, inp: RewardInput) -> float:
        """The reward of one sample (``batch == "sample"``)."""
        value = self.func(inp)
        if inspect.isawaitable(value):
            value = await value
        return self.to_reward(value, inp)

    async def score(self, inputs: list[RewardInput]) -> list[float]:
        """The rewards of ``inputs``: one call of a batched function, else one call each."""
        if self.batch == "sample":
            return list(await asyncio.gather(*(self(inp) for inp in inputs)))
        values = self.func(list(inputs))
        if inspect.isawaitable(values):
            values = await values
        if not isinstance(values, (list, tuple)) or len(values) != len(inputs):
            got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise ValueError(
                f"reward function {self.name} (--custom-rm-batch {self.batch}) got "
                f"{len(inputs)} inputs and returned {got}; expected a list of {len(inputs)}"
            )
        return [self.to_reward(v, inp) for v, inp in zip(values, inputs, strict=True)]

    def to_reward(self, value: Any, inp: RewardInput) -> float:
        """``value`` as a finite float (``--reward-key`` picks it out of a dict)."""
        where = f"reward function {self.name} ({inp.describe()})"
        if isinstance(value, dict):
            if self.reward_key is None:
                raise ValueError(f"{where} returned a dict {sorted(value)}; set --reward-key")
            if self.reward_key not in value:
                raise ValueError(
                    f"{where} returned a dict without '{self.reward_key}' (--reward-key); "
                    f"keys: {sorted(value)}"
                )
            value = value[self.reward_key]
        try:
            reward = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where} returned {value!r}, not a number") from None
        if not math.isfinite(reward):
            raise ValueError(f"{where} returned {reward}")
        return reward
