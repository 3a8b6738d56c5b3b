"""Bookkeeping of ``wait_until_healthy``, shared by the sync and async clients."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from miles_core.engine.errors import EngineError, EngineTimeoutError

logger = logging.getLogger("miles_core.engine")

#: Longest single ``/health`` poll.
HEALTH_POLL_TIMEOUT = 30.0


@dataclass
class HealthWait:
    """Deadline, progress lines and the last reason while polling ``GET /health``.

    A poll's outcome is recorded with :meth:`answered` (True: healthy; False: 503) or
    :meth:`failed` (transport errors mean "not yet"; any HTTP error is re-raised: a 401
    or 404 will not heal by waiting). :meth:`next_sleep` raises
    :class:`EngineTimeoutError` once ``timeout`` seconds have passed, writes a progress
    line every ``report_every`` seconds, and returns how long to sleep before the next poll.
    """

    base_url: str
    timeout: float
    interval: float = 1.0
    report_every: float = 10.0
    progress: Callable[[str], None] | None = None
    start: float = field(default_factory=time.monotonic)
    reason: str = "no answer yet"

    def __post_init__(self) -> None:
        self.deadline = self.start + self.timeout
        self.last_report = self.start
        self.report = self.progress or logger.info

    def poll_timeout(self) -> float:
        return min(HEALTH_POLL_TIMEOUT, max(self.deadline - time.monotonic(), 0.1))

    def answered(self, healthy: bool) -> bool:
        if healthy:
            self.report(
                f"engine {self.base_url} healthy after {time.monotonic() - self.start:.1f}s"
            )
        else:
            self.reason = "HTTP 503 (starting or unhealthy)"
        return healthy

    def failed(self, error: EngineError) -> None:
        if error.status_code is not None:
            raise error
        self.reason = error.message

    def next_sleep(self) -> float:
        now = time.monotonic()
        if now >= self.deadline:
            raise EngineTimeoutError(
                f"not healthy after {self.timeout:.0f}s; last: {self.reason}",
                endpoint="GET /health",
                base_url=self.base_url,
                status_code=None,
            )
        if now - self.last_report >= self.report_every:
            elapsed = now - self.start
            self.report(
                f"waiting for engine {self.base_url}: {elapsed:.0f}s of {self.timeout:.0f}s; {self.reason}"
            )
            self.last_report = now
        return min(self.interval, self.deadline - now)
