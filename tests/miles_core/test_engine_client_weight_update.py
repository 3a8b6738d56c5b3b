"""Engine client weight-update sessions: begin/end, the fallback for engines without them,
and the async client, which shares the sync client's behaviour."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from miles_core.engine import EngineError, EngineTimeoutError
from scripted_engine import Server, connect_error


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
