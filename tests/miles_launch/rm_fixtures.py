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
