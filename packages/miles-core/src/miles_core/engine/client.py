"""The synchronous engine client: SGLang's HTTP API over one ``httpx.Client``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from miles_core.engine.calls import EngineCall, EngineClientBase
from miles_core.engine.endpoints import EngineEndpoints, health_call
from miles_core.engine.errors import EngineError
from miles_core.engine.health_wait import HealthWait

logger = logging.getLogger(__name__)


class EngineClient(EngineClientBase, EngineEndpoints):
    """Talks to one engine (real SGLang or the built-in engine) at ``base_url``.

    >>> engine = EngineClient("http://127.0.0.1:30000", api_key=None, timeout=300, retries=3)
    >>> engine.wait_until_healthy(600)
    >>> out = engine.generate(input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=8))
    >>> with engine.weight_update():
    ...     engine.update_weights_from_tensor([payload], load_format="flattened_bucket")

    Failures raise :class:`~miles_core.engine.EngineError` (see ``calls.py`` for the retry
    policy). ``transport`` replaces httpx's network transport (tests pass
    ``httpx.MockTransport``). Use as a context manager, or call :meth:`close`.
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
        transport: httpx.BaseTransport | None = None,
    ):
        super().__init__(
            base_url=base_url,
            api_key=api_key,
            timeout=timeout,
            connect_timeout=connect_timeout,
            retries=retries,
            retry_backoff=retry_backoff,
        )
        self._http = httpx.Client(
            base_url=self.base_url, headers=self.headers(), transport=transport
        )

    def _call(self, call: EngineCall, *, retry: bool = True) -> Any:
        if self.skipped(call):
            return False
        attempt = 0
        while True:
            try:
                response = self._http.request(
                    call.method, call.path, json=call.body, timeout=self.http_timeout(call)
                )
            except httpx.TransportError as error:
                if not (retry and self.retryable(error, call, attempt)):
                    raise self.transport_error(error, call) from error
                delay = self.backoff(attempt)
                logger.warning(
                    "%s on %s: %s; retrying in %.1fs", call.endpoint, self.base_url, error, delay
                )
                time.sleep(delay)
                attempt += 1
                continue
            return self.finish(call, response)

    @contextmanager
    def weight_update(self, selector: str = "all") -> Iterator[EngineClient]:
        """``begin_weight_update`` on entry and ``end_weight_update`` on exit, sent even when
        the block raises (an error of the end call is then logged, and the block's error
        propagates). Both are skipped on servers without them (404)."""
        self.begin_weight_update(selector)
        try:
            yield self
        except BaseException:
            try:
                self.end_weight_update()
            except EngineError as error:
                logger.warning("end_weight_update after a failed update also failed: %s", error)
            raise
        self.end_weight_update()

    def wait_until_healthy(
        self,
        timeout: float = 600.0,
        *,
        interval: float = 1.0,
        report_every: float = 10.0,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        """Poll ``GET /health`` until it answers 200.

        Connection errors and 503 mean "not yet"; any other HTTP error (401: wrong API key;
        404: not an engine) raises at once. Every ``report_every`` seconds a progress line
        (elapsed time, last reason) goes to ``progress`` (default: this module's logger at
        INFO; pass ``print`` for the console). Raises :class:`EngineTimeoutError` after
        ``timeout`` seconds.
        """
        wait = HealthWait(self.base_url, timeout, interval, report_every, progress)
        while True:
            try:
                if wait.answered(
                    self._call(health_call("/health", wait.poll_timeout()), retry=False)
                ):
                    return
            except EngineError as error:
                wait.failed(error)
            time.sleep(wait.next_sleep())

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
