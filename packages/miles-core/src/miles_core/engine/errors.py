"""Exceptions of the engine client: every failure names the endpoint and the server's words."""

from __future__ import annotations


class EngineError(Exception):
    """A request to an engine failed.

    ``status_code`` is the HTTP status of the reply (``None`` when no reply came: a
    connection error or a timeout), ``endpoint`` the method and path (``"POST
    /update_weights_from_tensor"``), ``message`` the server's message (from
    ``{"error": {"message": ...}}``, ``{"message": ...}`` or the plain-text body) or the
    transport error.
    """

    def __init__(self, message: str, *, endpoint: str, base_url: str, status_code: int | None):
        self.message = message
        self.endpoint = endpoint
        self.base_url = base_url
        self.status_code = status_code
        where = f"{endpoint} on {base_url}"
        if status_code is None:
            super().__init__(f"{where} failed: {message}")
        else:
            super().__init__(f"{where} failed with HTTP {status_code}: {message}")

    def __reduce__(self):
        # Keyword-only arguments: rebuild explicitly so the error survives pickling (Ray).
        kwargs = {
            "endpoint": self.endpoint,
            "base_url": self.base_url,
            "status_code": self.status_code,
        }
        return _rebuild, (type(self), self.message, kwargs)


class EngineConnectionError(EngineError):
    """No connection to the engine could be made (after the configured retries)."""


class EngineTimeoutError(EngineError):
    """The engine did not answer in time (a read timeout: the request may have been received)."""


def _rebuild(cls: type[EngineError], message: str, kwargs: dict) -> EngineError:
    return cls(message, **kwargs)
