"""The transport-independent half of the engine client: what a call is, how a reply is read.

Both :class:`~miles_core.engine.EngineClient` (sync) and
:class:`~miles_core.engine.AsyncEngineClient` send :class:`EngineCall` objects built by
:class:`~miles_core.engine.endpoints.EngineEndpoints`, and both hand the reply to
:meth:`EngineClientBase.finish`; only the sending differs.

Retry policy (:meth:`EngineClientBase.retryable`): a call is re-sent only when the server
cannot have seen it — the connection could not be made (``ConnectError``,
``ConnectTimeout``) or no pooled connection became free (``PoolTimeout``). A read timeout or
a dropped connection after the request went out is retried only for idempotent calls
(``GET``s, ``flush_cache``, ``abort_request``): re-sending a ``/generate`` or a weight
update the server may already be running would run it twice. HTTP errors are never retried.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from miles_core.engine.errors import EngineConnectionError, EngineError, EngineTimeoutError

#: Transport errors raised before any byte of the request reached the server.
NOT_SENT_ERRORS: tuple[type[Exception], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
)
#: Errors after which an idempotent call may be sent again.
IDEMPOTENT_RETRY_ERRORS: tuple[type[Exception], ...] = (
    httpx.ReadTimeout,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
)


def read_body(response: httpx.Response) -> Any:
    """The reply as JSON when it parses, else its text (``None`` for an empty body)."""
    if not response.content:
        return None
    try:
        return response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return response.text


def server_message(response: httpx.Response) -> str:
    """The server's explanation of a failed reply.

    Tried in order: ``{"error": {"message": m}}`` (SGLang handler errors),
    ``{"error": m}`` (the /generate contract gate), ``{"message": m}`` (update endpoints'
    ``success: false`` and FastAPI's ``ErrorResponse``), ``{"detail": d}`` (plain FastAPI),
    then the body's text, then the reason phrase.
    """
    body = read_body(response)
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message") is not None:
            return str(error["message"])
        if isinstance(error, str):
            return error
        for key in ("message", "detail"):
            if body.get(key) is not None:
                return str(body[key])
    if isinstance(body, str) and body.strip():
        return body.strip()
    if body is not None:
        return json.dumps(body)
    return response.reason_phrase or "no message"


@dataclass(frozen=True)
class EngineCall:
    """One HTTP request to an engine and how to read its reply.

    ``body`` is ``None`` only for GETs: every POST carries a JSON object (``{}`` at least),
    since SGLang 0.5.23 answers a missing body with 400. ``accept`` lists non-2xx statuses
    that are answers rather than failures (503 from ``/health``). ``parse`` turns the reply
    into the method's return value (default: the JSON body). ``check_success`` raises on a
    ``{"success": false}`` reply. ``feature`` names an optional server feature: a 404
    marks it unsupported on this client, the call returns ``False`` and later calls of it
    are not sent.
    """

    method: str
    path: str
    body: dict[str, Any] | None = None
    idempotent: bool = False
    accept: frozenset[int] = frozenset()
    parse: Callable[[httpx.Response], Any] | None = None
    check_success: bool = False
    feature: str | None = None
    timeout: float | None = None

    def __post_init__(self) -> None:
        if self.method != "GET" and self.body is None:
            raise ValueError(f"{self.method} {self.path}: a JSON body is required ({{}} at least)")

    @property
    def endpoint(self) -> str:
        return f"{self.method} {self.path}"


@dataclass(eq=False)
class EngineClientBase:
    """Configuration and reply handling shared by the sync and async clients.

    ``timeout`` is the read/write timeout of a call in seconds (``None``: wait forever),
    overridable per call; ``connect_timeout`` bounds making the connection. ``retries``
    is how many times a call is re-sent after a retryable transport error, sleeping
    ``retry_backoff * 2**attempt`` seconds (at most ``max_backoff``) in between.
    """

    base_url: str
    api_key: str | None = field(default=None, repr=False)
    timeout: float | None = 300.0
    connect_timeout: float = 10.0
    retries: int = 3
    retry_backoff: float = 0.5
    max_backoff: float = 8.0
    #: Optional features (``EngineCall.feature``) the server answered 404 for.
    unsupported: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"engine base_url must start with http:// or https://: {self.base_url!r}"
            )
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")

    @property
    def supports_weight_update_session(self) -> bool:
        """False once the server answered 404 to ``/begin_weight_update`` (SGLang < 0.5.23)."""
        return "weight_update_session" not in self.unsupported

    def headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def http_timeout(self, call: EngineCall) -> httpx.Timeout:
        read = call.timeout if call.timeout is not None else self.timeout
        connect = self.connect_timeout if read is None else min(self.connect_timeout, read)
        return httpx.Timeout(read, connect=connect)

    def skipped(self, call: EngineCall) -> bool:
        """Whether the call targets a feature this server is known to lack."""
        return call.feature is not None and call.feature in self.unsupported

    def retryable(self, error: Exception, call: EngineCall, attempt: int) -> bool:
        if attempt >= self.retries:
            return False
        if isinstance(error, NOT_SENT_ERRORS):
            return True
        return call.idempotent and isinstance(error, IDEMPOTENT_RETRY_ERRORS)

    def backoff(self, attempt: int) -> float:
        return min(self.retry_backoff * 2**attempt, self.max_backoff)

    def transport_error(self, error: Exception, call: EngineCall) -> EngineError:
        """The :class:`EngineError` for a transport error: a connection that could not be
        made is an :class:`EngineConnectionError`, a reply that did not come in time an
        :class:`EngineTimeoutError`."""
        if isinstance(error, NOT_SENT_ERRORS):
            kind: type[EngineError] = EngineConnectionError
        elif isinstance(error, httpx.TimeoutException):
            kind = EngineTimeoutError
        else:
            kind = EngineError
        message = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        return kind(message, endpoint=call.endpoint, base_url=self.base_url, status_code=None)

    def finish(self, call: EngineCall, response: httpx.Response) -> Any:
        """Turn a reply into the call's result, or raise :class:`EngineError`."""
        status = response.status_code
        if call.feature is not None and status == 404:
            self.unsupported.add(call.feature)
            return False
        if status >= 400 and status not in call.accept:
            raise EngineError(
                server_message(response),
                endpoint=call.endpoint,
                base_url=self.base_url,
                status_code=status,
            )
        if call.check_success:
            body = read_body(response)
            if isinstance(body, dict) and body.get("success") is False:
                raise EngineError(
                    str(body.get("message") or "success: false"),
                    endpoint=call.endpoint,
                    base_url=self.base_url,
                    status_code=status,
                )
        if call.parse is not None:
            return call.parse(response)
        return read_body(response)
