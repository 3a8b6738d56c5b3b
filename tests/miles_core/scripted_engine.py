"""A scripted engine for the engine-client tests: an ``httpx.MockTransport`` handler
(httpx's own test transport) that replays canned replies per route and records requests."""

from __future__ import annotations

import httpx
from miles_core.engine import AsyncEngineClient, EngineClient


class Server:
    """A scripted MockTransport handler: ``routes[(method, path)]`` is a list of replies
    (an ``httpx.Response`` or an exception to raise) consumed in order; the last repeats."""

    def __init__(self, routes: dict[tuple[str, str], list] | None = None):
        self.routes = routes or {}
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        replies = self.routes.get((request.method, request.url.path))
        if replies is None:
            return httpx.Response(200, json={"success": True, "message": "ok"})
        reply = replies.pop(0) if len(replies) > 1 else replies[0]
        if isinstance(reply, Exception):
            raise reply
        return reply

    def paths(self) -> list[str]:
        return [f"{r.method} {r.url.path}" for r in self.requests]

    def client(self, **kwargs) -> EngineClient:
        kwargs.setdefault("retry_backoff", 0.0)
        return EngineClient("http://engine:30000", transport=httpx.MockTransport(self), **kwargs)

    def async_client(self, **kwargs) -> AsyncEngineClient:
        kwargs.setdefault("retry_backoff", 0.0)
        return AsyncEngineClient(
            "http://engine:30000", transport=httpx.MockTransport(self), **kwargs
        )


def connect_error() -> httpx.ConnectError:
    return httpx.ConnectError("[Errno 111] Connection refused")
