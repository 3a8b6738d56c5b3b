"""The asynchronous engine client: the same endpoints over one ``httpx.AsyncClient``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx

from miles_core.engine.calls import EngineCall, EngineClientBase
from miles_core.engine.endpoints import EngineEndpoints, health_call
from miles_core.engine.errors import EngineError
from miles_core.engine.health_wait import HealthWait

logger = logging.getLogger(__name__)


class AsyncEngineClient(EngineClientBase, EngineEndpoints):
    """:class:`~miles_core.engine.EngineClient` for asyncio: every endpoint method returns
    an awaitable of the same reply, with the same timeouts, retries and errors.

    >>> async with AsyncEngineClient("http://127.0.0.1:30000") as engine:
    ...     outs = await asyncio.gather(*(engine.generate(text=p) for p in prompts))
    ...     async with engine.weight_update():
    ...         await engine.update_weights_from_tensor([payload])
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout: float | None = 300.0,
        retries: int = 3,
        *,
        connect_timeout: float = 10.0,
        retry_backoff: float = 0.5,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        super().__init__(
            base_url=base_url,
            api_key=api_key,
            timeout=timeout,
            connect_timeout=connect_timeout,
            retries=retries,
            retry_backoff=retry_backoff,
        )
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=self.headers(), transport=transport
        )

    async def _call(self, call: EngineCall, *, retry: bool = True) -> Any:
        if self.skipped(call):
            return False
        attempt = 0
        while True:
            try:
                response = await self._http.request(
                    call.method, call.path, json=call.body, timeout=self.http_timeout(call)
                )
            except httpx.TransportError as error:
                if not (retry and self.retryable(error, call, attempt)):
                    raise self.transport_error(error, call) from error
                delay = self.backoff(attempt)
                logger.warning(
                    "%s on %s: %s; retrying in %.1fs", call.endpoint, self.base_url, error, delay
                )
                await asyncio.sleep(delay)
                attempt += 1
                continue
            return self.finish(call, response)

    @asynccontextmanager
    async def weight_update(self, selector: str = "all") -> AsyncIterator[AsyncEngineClient]:
        """``begin_weight_update`` / ``end_weight_update`` around the block; the end is sent
        even when the block raises (see :meth:`EngineClient.weight_update`)."""
        await self.begin_weight_update(selector)
        try:
            yield self
        except BaseException:
            try:
                await self.end_weight_update()
            except EngineError as error:
                logger.warning("end_weight_update after a failed update also failed: %s", error)
            raise
        await self.end_weight_update()

    async def wait_until_healthy(
        self,
        timeout: float = 600.0,
        *,
        interval: float = 1.0,
        report_every: float = 10.0,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        """Poll ``GET /health`` until 200 (see :meth:`EngineClient.wait_until_healthy`)."""
        wait = HealthWait(self.base_url, timeout, interval, report_every, progress)
        while True:
            try:
                healthy = await self._call(health_call("/health", wait.poll_timeout()), retry=False)
                if wait.answered(healthy):
                    return
            except EngineError as error:
                wait.failed(error)
            await asyncio.sleep(wait.next_sleep())

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncEngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
