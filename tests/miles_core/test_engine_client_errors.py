"""Engine client errors: the server's message is carried, errors pickle, ``success: false``
raises, health answers."""

from __future__ import annotations

import pickle

import httpx
import pytest
from miles_core.engine import EngineError, EngineTimeoutError
from scripted_engine import Server


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
