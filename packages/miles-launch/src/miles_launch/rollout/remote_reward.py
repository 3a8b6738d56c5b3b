"""``--rm-url``: a remote reward server, one ``POST`` per sample.

The request body is a JSON object with the sample's ``prompt``, ``response``, ``label``,
``metadata``, ``finish_reason``, ``response_ids``, ``max_response_len``, ``prompt_index`` and
``sample_index``; the reply is a JSON number, or an object from which ``--reward-key`` picks
the reward. A request that times out (``--rm-timeout`` seconds), cannot connect, or is answered
with 429 or a 5xx is tried again after 0.5 s, 1 s, 2 s, ... at most ``--rm-max-retries`` times;
any other error status fails at once. The error names the server, the sample and the cause.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any

import httpx

from miles_launch.rollout.rewards import RewardInput


class RewardServerError(RuntimeError):
    """The reward server did not score a sample (the message names server and sample)."""


def _retryable(status: int) -> bool:
    return status == 429 or status >= 500


class RemoteReward:
    """An async reward function that posts each sample to ``url``."""

    def __init__(
        self, url: str, *, timeout_s: float, max_retries: int, backoff_s: float = 0.5
    ) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s

    async def __call__(self, inp: RewardInput) -> Any:
        body = asdict(inp)
        body["response_ids"] = list(inp.response_ids)
        where = f"--rm-url {self.url}: {inp.describe()}"
        attempts = self.max_retries + 1
        cause = ""
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            for attempt in range(attempts):
                if attempt:
                    await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
                try:
                    reply = await client.post(self.url, json=body)
                except httpx.TimeoutException:
                    cause = f"no reply within {self.timeout_s:g}s (--rm-timeout)"
                    continue
                except httpx.TransportError as error:
                    cause = f"cannot connect ({type(error).__name__}: {error})"
                    continue
                if reply.is_success:
                    try:
                        return reply.json()
                    except ValueError:
                        raise RewardServerError(
                            f"{where}: the reply is not JSON: {reply.text[:200]!r}"
                        ) from None
                cause = f"HTTP {reply.status_code}: {reply.text[:200]!r}"
                if not _retryable(reply.status_code):
                    raise RewardServerError(f"{where}: {cause}")
        raise RewardServerError(f"{where}: {cause} ({attempts} attempts)")
