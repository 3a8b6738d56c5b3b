"""Engine client connection handling: which failures are retried, against scripted replies
and real sockets on 127.0.0.1 (a closed port, a listener that never answers), and
``wait_until_healthy`` polling."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest
from miles_core.engine import EngineClient, EngineConnectionError, EngineError, EngineTimeoutError
from miles_core.ports import free_port
from scripted_engine import Server, connect_error


def test_connect_errors_are_retried_then_succeed():
    server = Server(
        {
            ("POST", "/generate"): [
                connect_error(),
                httpx.ConnectTimeout("timed out connecting"),
                httpx.Response(200, json={"text": "ok"}),
            ]
        }
    )
    assert server.client(retries=2).generate("x") == {"text": "ok"}
    assert server.paths() == ["POST /generate"] * 3


@pytest.mark.parametrize("error", [connect_error(), httpx.ConnectTimeout("timed out connecting")])
def test_connect_errors_exhaust_retries(error):
    server = Server({("POST", "/update_weight_version"): [error]})
    with pytest.raises(EngineConnectionError) as info:
        server.client(retries=3).update_weight_version("v1")
    assert len(server.requests) == 4
    assert info.value.status_code is None
    assert info.value.endpoint == "POST /update_weight_version"
    assert type(error).__name__ in str(info.value)


@pytest.mark.parametrize(
    "error",
    [
        httpx.ReadTimeout("read timed out"),
        httpx.RemoteProtocolError("Server disconnected without sending a response."),
        httpx.ReadError("connection reset"),
    ],
)
def test_a_post_that_may_have_arrived_is_never_resent(error):
    server = Server({("POST", "/update_weights_from_tensor"): [error]})
    with pytest.raises(EngineError) as info:
        server.client(retries=5).update_weights_from_tensor(["AAAA"])
    assert len(server.requests) == 1
    assert info.value.status_code is None
    assert isinstance(info.value, EngineTimeoutError) == isinstance(error, httpx.ReadTimeout)


def test_idempotent_calls_are_retried_after_a_dropped_reply():
    server = Server(
        {
            ("GET", "/get_model_info"): [
                httpx.ReadTimeout("read timed out"),
                httpx.RemoteProtocolError("Server disconnected"),
                httpx.Response(200, json={"weight_version": "v7"}),
            ]
        }
    )
    assert server.client(retries=2).get_model_info()["weight_version"] == "v7"
    assert len(server.requests) == 3


def test_http_errors_are_not_retried():
    server = Server({("POST", "/generate"): [httpx.Response(500, text="boom")]})
    with pytest.raises(EngineError) as info:
        server.client(retries=3).generate("x")
    assert len(server.requests) == 1
    assert info.value.status_code == 500 and info.value.message == "boom"


class CountingTransport(httpx.HTTPTransport):
    def __init__(self):
        super().__init__()
        self.attempts = 0

    def handle_request(self, request):
        self.attempts += 1
        return super().handle_request(request)


def test_real_refused_connection_is_retried():
    transport = CountingTransport()
    client = EngineClient(
        f"http://127.0.0.1:{free_port()}", retries=2, retry_backoff=0.0, transport=transport
    )
    with pytest.raises(EngineConnectionError):
        client.generate("x")
    assert transport.attempts == 3


def test_real_read_timeout_is_not_retried_for_generate():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.05)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept():  # take connections (and so the requests), never answer
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    port = listener.getsockname()[1]
    try:
        with EngineClient(f"http://127.0.0.1:{port}", retries=3, retry_backoff=0.0) as client:
            with pytest.raises(EngineTimeoutError, match="ReadTimeout"):
                client.generate("x", timeout=0.3)
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()
    assert len(accepted) == 1
    for conn in accepted:
        conn.close()


def test_wait_until_healthy_polls_through_refusals_and_503():
    server = Server(
        {
            ("GET", "/health"): [
                connect_error(),
                connect_error(),
                httpx.Response(503),
                httpx.Response(200),
            ]
        }
    )
    lines: list[str] = []
    server.client(retries=0).wait_until_healthy(
        10, interval=0.01, report_every=0.0, progress=lines.append
    )
    assert len(server.requests) == 4
    assert any("Connection refused" in line for line in lines)
    assert any("503" in line for line in lines)
    assert "healthy after" in lines[-1]


def test_wait_until_healthy_times_out_with_the_last_reason():
    server = Server({("GET", "/health"): [httpx.Response(503)]})
    with pytest.raises(EngineTimeoutError, match="not healthy after .*503"):
        server.client().wait_until_healthy(0.2, interval=0.02, progress=lambda line: None)


def test_wait_until_healthy_stops_at_once_on_a_wrong_api_key():
    server = Server(
        {("GET", "/health"): [httpx.Response(401, json={"error": {"message": "Unauthorized"}})]}
    )
    with pytest.raises(EngineError, match="Unauthorized"):
        server.client(api_key="wrong").wait_until_healthy(30, interval=0.01)
    assert len(server.requests) == 1
