"""Custom reward functions loaded by tests through --custom-rm-path."""

from __future__ import annotations

import asyncio


def response_length(inp) -> float:
    return float(len(inp.response))


async def async_label_match(inp) -> float:
    await asyncio.sleep(0)
    return 1.0 if inp.response == inp.label else 0.0


def not_a_number(inp):
    return "high"


def dict_reward(inp) -> dict:
    return {"accuracy": float(len(inp.response)), "format": 1.0}


BATCH_CALLS: list[list[int]] = []  # the prompt indices of each batched call


async def async_batch_length(inputs) -> list[float]:
    await asyncio.sleep(0)
    BATCH_CALLS.append([inp.prompt_index for inp in inputs])
    return [float(len(inp.response)) for inp in inputs]


def one_value(inputs) -> list[float]:
    return [0.0]


def even_samples_pass(inp) -> float:
    """1.0 for samples 0, 2, 4, ... of each prompt: ``c = ceil(n / 2)`` of ``n`` pass."""
    return 1.0 if inp.sample_index % 2 == 0 else 0.0


def shaped_quarters(inp) -> float:
    """A shaped reward: samples 0, 1, 2, 3 of each prompt (cyclically) earn 1.0, 0.5, 0.0, 0.5
    (partial credit, e.g. for calling a tool); only the first reaches the maximum."""
    return (1.0, 0.5, 0.0, 0.5)[inp.sample_index % 4]


def group_size(args, group) -> int:
    """A --dynamic-sampling-filter-path that returns a number, not True or False."""
    return len(group)
