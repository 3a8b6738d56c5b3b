"""Behaviour of the engine client: retries, timeouts, errors, auth, begin/end fallback.

Servers are ``httpx.MockTransport`` handlers (httpx's own test transport) or, for the
connection-level behaviours, real sockets on 127.0.0.1: a closed port (connection refused)
and a listener that accepts and never answers (read timeout).
"""

from __future__ import annotations

import asyncio
import base64
import json
import pickle
import socket
import threading

import httpx
import numpy as np
import pytest
import torch
from miles_core.engine import (
    AsyncEngineClient,
    EngineClient,
    EngineConnectionError,
    EngineError,
    EngineTimeoutError,
    SamplingParams,
    decode_routed_experts,
)


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


# ---------------------------------------------------------------------------- headers and bodies


def test_bearer_header_only_with_api_key():
    server = Server()
    server.client(api_key="sekrit").get_model_info()
    server.client().get_model_info()
    assert server.requests[0].headers["authorization"] == "Bearer sekrit"
    assert "authorization" not in server.requests[1].headers


def test_posts_without_arguments_send_an_empty_json_object():
    server = Server()
    client = server.client()
    client.continue_generation()
    client.flush_cache()
    client.end_weight_update()
    client.release_memory_occupation()
    client.resume_memory_occupation()
    for request in server.requests:
        assert request.method == "POST"
        assert request.headers["content-type"] == "application/json"
        assert json.loads(request.content) == {}


def test_generate_body_and_argument_checks():
    server = Server({("POST", "/generate"): [httpx.Response(200, json=[{"text": "a"}] * 2)]})
    client = server.client()
    out = client.generate(
        input_ids=[[1, 2], [3]], sampling_params=SamplingParams(max_new_tokens=4, temperature=0.0)
    )
    assert out == [{"text": "a"}] * 2
    body = json.loads(server.requests[0].content)
    assert body == {
        "input_ids": [[1, 2], [3]],
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
    }
    with pytest.raises(ValueError, match="exactly one of text or input_ids"):
        client.generate("a", input_ids=[1])
    with pytest.raises(ValueError, match="exactly one of text or input_ids"):
        client.generate()
    with pytest.raises(ValueError, match="pause mode"):
        client.pause_generation("later")
    with pytest.raises(ValueError, match="memory tags"):
        client.release_memory_occupation(["weights", "optimizer"])
    with pytest.raises(ValueError, match="differ in length"):
        client.update_weights_from_distributed(["a"], ["float32", "float32"], [[1]])
    assert len(server.requests) == 1  # refused before sending


def test_weight_update_bodies_send_only_what_is_set():
    server = Server()
    client = server.client()
    client.init_weights_update_group("10.0.0.1", 29500, 1, 3)
    client.update_weights_from_distributed(["w", "b"], [torch.bfloat16, "float32"], [(2, 3), [4]])
    client.update_weights_from_tensor(["AAAA"], load_format="flattened_bucket", weight_version="v2")
    client.update_weights_from_disk("/ckpt")
    client.update_weight_version(12)
    client.abort_request()
    bodies = [json.loads(r.content) for r in server.requests]
    assert bodies == [
        {
            "master_address": "10.0.0.1",
            "master_port": 29500,
            "rank_offset": 1,
            "world_size": 3,
            "group_name": "weight_update_group",
            "backend": "nccl",
        },
        {
            "names": ["w", "b"],
            "dtypes": ["bfloat16", "float32"],
            "shapes": [[2, 3], [4]],
            "group_name": "weight_update_group",
        },
        {
            "serialized_named_tensors": ["AAAA"],
            "load_format": "flattened_bucket",
            "weight_version": "v2",
        },
        {"model_path": "/ckpt"},
        {"new_version": "12", "abort_all_requests": True},
        {"rid": "", "abort_all": False},
    ]
    with pytest.raises(TypeError, match="base64 strings"):
        client.update_weights_from_tensor([b"raw bytes"])


def test_per_call_timeout_overrides_the_client_default():
    server = Server()
    client = server.client(timeout=42.0, connect_timeout=3.0)
    client.get_model_info()
    client.generate("x", timeout=7.5)
    default, override = (r.extensions["timeout"] for r in server.requests)
    assert default == {"connect": 3.0, "read": 42.0, "write": 42.0, "pool": 42.0}
    assert override["read"] == 7.5 and override["connect"] == 3.0


# ---------------------------------------------------------------------------- retries


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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("status", "reply", "message"),
    [
        (400, {"error": {"message": "pause mode invalid"}}, "pause mode invalid"),
        (400, {"error": "unknown field `topk`, expected one of ..."}, "unknown field `topk`"),
        (400, {"success": False, "message": "shape mismatch for w"}, "shape mismatch for w"),
        (400, {"object": "error", "message": "Field required", "code": 400}, "Field required"),
        (422, {"detail": "Not Found"}, "Not Found"),
        (400, "Cache not flushed: 2 requests running.\n", "Cache not flushed: 2 requests running."),
        (401, None, "Unauthorized"),
    ],
)
def test_error_carries_the_server_message(status, reply, message):
    if isinstance(reply, str):
        response = httpx.Response(status, text=reply)
    elif reply is None:
        response = httpx.Response(status)
    else:
        response = httpx.Response(status, json=reply)
    server = Server({("POST", "/update_weights_from_disk"): [response]})
    with pytest.raises(EngineError) as info:
        server.client().update_weights_from_disk("/ckpt")
    assert info.value.status_code == status
    assert info.value.endpoint == "POST /update_weights_from_disk"
    assert info.value.message.startswith(message)
    assert f"HTTP {status}" in str(info.value) and "http://engine:30000" in str(info.value)


def test_errors_survive_pickling():
    error = EngineTimeoutError(
        "ReadTimeout", endpoint="POST /generate", base_url="http://e", status_code=None
    )
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is EngineTimeoutError and str(again) == str(error)
    assert (again.endpoint, again.base_url, again.status_code) == (
        "POST /generate",
        "http://e",
        None,
    )


def test_success_false_with_status_200_raises():
    reply = httpx.Response(200, json={"success": False, "message": "group g does not exist"})
    server = Server({("POST", "/destroy_weights_update_group"): [reply]})
    with pytest.raises(EngineError, match="group g does not exist") as info:
        server.client().destroy_weights_update_group("g")
    assert info.value.status_code == 200


def test_health_is_false_on_503_and_raises_on_other_errors():
    server = Server(
        {
            ("GET", "/health"): [httpx.Response(503), httpx.Response(200)],
            ("GET", "/health_generate"): [httpx.Response(500, text="dead")],
        }
    )
    client = server.client()
    assert client.health() is False
    assert client.health() is True
    with pytest.raises(EngineError, match="dead"):
        client.health_generate()


# ---------------------------------------------------------------------------- begin/end fallback


def test_begin_end_skipped_after_404():
    server = Server(
        {("POST", "/begin_weight_update"): [httpx.Response(404, json={"detail": "Not Found"})]}
    )
    client = server.client()
    assert client.supports_weight_update_session
    assert client.begin_weight_update() is False
    assert not client.supports_weight_update_session
    assert client.end_weight_update() is False
    with client.weight_update():
        client.update_weights_from_tensor(["AAAA"])
    assert server.paths() == ["POST /begin_weight_update", "POST /update_weights_from_tensor"]


def test_weight_update_sends_end_even_when_the_block_fails():
    server = Server(
        {
            ("POST", "/update_weights_from_tensor"): [
                httpx.Response(400, json={"success": False, "message": "bad bucket"})
            ]
        }
    )
    client = server.client()
    with pytest.raises(EngineError, match="bad bucket"):
        with client.weight_update():
            client.update_weights_from_tensor(["AAAA"])
    assert server.paths() == [
        "POST /begin_weight_update",
        "POST /update_weights_from_tensor",
        "POST /end_weight_update",
    ]
    assert json.loads(server.requests[0].content) == {"selector": "all"}
    assert json.loads(server.requests[2].content) == {}


def test_weight_update_keeps_the_block_error_when_end_fails_too():
    server = Server(
        {
            ("POST", "/end_weight_update"): [
                httpx.Response(400, json={"success": False, "message": "no session"})
            ]
        }
    )
    client = server.client()
    with pytest.raises(RuntimeError, match="trainer died"):
        with client.weight_update():
            raise RuntimeError("trainer died")
    with pytest.raises(EngineError, match="no session"):
        with client.weight_update():
            pass


def test_begin_failure_other_than_404_raises():
    server = Server(
        {
            ("POST", "/begin_weight_update"): [
                httpx.Response(400, json={"success": False, "message": "already open"})
            ]
        }
    )
    client = server.client()
    with pytest.raises(EngineError, match="already open"):
        client.begin_weight_update()
    assert client.supports_weight_update_session


# ---------------------------------------------------------------------------- wait_until_healthy


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


# ---------------------------------------------------------------------------- async client


def test_async_client_shares_the_behaviour():
    async def scenario():
        server = Server(
            {
                ("POST", "/generate"): [connect_error(), httpx.Response(200, json={"text": "ok"})],
                ("POST", "/begin_weight_update"): [httpx.Response(404)],
                ("GET", "/health"): [connect_error(), httpx.Response(200)],
                ("POST", "/update_weights_from_tensor"): [httpx.ReadTimeout("slow")],
            }
        )
        async with server.async_client(api_key="k", retries=1) as client:
            assert await client.generate("x") == {"text": "ok"}
            await client.wait_until_healthy(5, interval=0.01, progress=lambda line: None)
            with pytest.raises(EngineTimeoutError):
                async with client.weight_update():
                    await client.update_weights_from_tensor(["AAAA"])
            assert await client.end_weight_update() is False
        return server

    server = asyncio.run(scenario())
    assert server.paths() == [
        "POST /generate",
        "POST /generate",
        "GET /health",
        "GET /health",
        "POST /begin_weight_update",
        "POST /update_weights_from_tensor",
    ]
    assert all(r.headers["authorization"] == "Bearer k" for r in server.requests)


def test_async_weight_update_sends_end_on_failure():
    async def scenario():
        server = Server()
        async with server.async_client() as client:
            with pytest.raises(KeyError):
                async with client.weight_update("target"):
                    raise KeyError("lost")
        return server

    server = asyncio.run(scenario())
    assert server.paths() == ["POST /begin_weight_update", "POST /end_weight_update"]
    assert json.loads(server.requests[0].content) == {"selector": "target"}


# ---------------------------------------------------------------------------- routed experts


def test_decode_routed_experts_round_trip():
    rng = np.random.default_rng(0)
    experts = rng.integers(0, 64, size=(5, 3, 2), dtype=np.int32)
    # SGLang's wire form: base64 of the raw little-endian int32 bytes.
    encoded = base64.b64encode(experts.astype("<i4").tobytes()).decode()
    decoded = decode_routed_experts(encoded, num_layers=3, topk=2)
    assert decoded.dtype == np.int32 and decoded.shape == (5, 3, 2)
    np.testing.assert_array_equal(decoded, experts)
    assert decoded[4, 2, 1] == experts.reshape(-1)[-1]


def test_decode_routed_experts_rejects_bad_input():
    with pytest.raises(ValueError, match="not a multiple of"):
        decode_routed_experts(base64.b64encode(b"\0" * 20).decode(), num_layers=3, topk=2)
    with pytest.raises(ValueError, match="not valid base64"):
        decode_routed_experts("%%%", num_layers=1, topk=1)
    assert decode_routed_experts("", num_layers=2, topk=2).shape == (0, 2, 2)
