"""``--rm-url``: rewards from a reward server on loopback, its retries, timeout and errors."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from launch_testing import parse
from miles_launch.rollout.remote_reward import RewardServerError
from miles_launch.rollout.rewards import RewardInput, RewardModel


class RewardServer:
    """``/score``: ``{"score": len(response)}``; ``/flaky``: two 500s, then as ``/score``;
    ``/fail``: always 500; ``/bad``: 400; ``/slow``: answers after 2 s. Records each body."""

    def __init__(self):
        self.bodies: list[tuple[str, dict]] = []
        self.flaky_left = 2
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.bodies.append((self.path, body))
                status, reply = 200, {"score": float(len(body["response"]))}
                if self.path == "/flaky" and server.flaky_left > 0:
                    server.flaky_left -= 1
                    status, reply = 500, {"error": "warming up"}
                elif self.path == "/fail":
                    status, reply = 500, {"error": "judge crashed"}
                elif self.path == "/bad":
                    status, reply = 400, {"error": "no label"}
                elif self.path == "/slow":
                    time.sleep(2)
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = RewardServer()
    yield s
    s.close()


INP = RewardInput(
    prompt="1+1=",
    response="two",
    label="2",
    response_ids=(5, 6, 7),
    finish_reason="stop",
    max_response_len=8,
    metadata={"source": "gsm8k"},
    prompt_index=4,
    sample_index=1,
)


def remote(tmp_path, url, *flags):
    model = RewardModel.from_args(parse(tmp_path, "--rm-url", url, "--reward-key", "score", *flags))
    model.func.backoff_s = 0.01  # the schedule is 0.5 s, 1 s, ...; the tests need not wait
    return model


def test_the_server_gets_the_sample_and_its_reply_is_the_reward(tmp_path, server):
    assert asyncio.run(remote(tmp_path, server.url + "/score")(INP)) == 3.0
    ((path, body),) = server.bodies
    assert path == "/score"
    assert body == {
        "prompt": "1+1=",
        "response": "two",
        "label": "2",
        "response_ids": [5, 6, 7],
        "finish_reason": "stop",
        "max_response_len": 8,
        "metadata": {"source": "gsm8k"},
        "prompt_index": 4,
        "sample_index": 1,
    }


def test_a_500_is_retried_until_the_server_answers(tmp_path, server):
    assert asyncio.run(remote(tmp_path, server.url + "/flaky")(INP)) == 3.0
    assert len(server.bodies) == 3


def test_a_lasting_500_names_the_server_and_the_sample(tmp_path, server):
    url = server.url + "/fail"
    with pytest.raises(RewardServerError) as info:
        asyncio.run(remote(tmp_path, url, "--rm-max-retries", "2")(INP))
    assert str(info.value) == (
        f"--rm-url {url}: sample 1 of prompt 4: HTTP 500: "
        """'{"error": "judge crashed"}' (3 attempts)"""
    )
    assert len(server.bodies) == 3


def test_a_client_error_is_not_retried(tmp_path, server):
    with pytest.raises(RewardServerError, match=r"sample 1 of prompt 4: HTTP 400: .*no label"):
        asyncio.run(remote(tmp_path, server.url + "/bad")(INP))
    assert len(server.bodies) == 1


def test_a_slow_server_times_out(tmp_path, server):
    model = remote(tmp_path, server.url + "/slow", "--rm-timeout", "0.2", "--rm-max-retries", "1")
    start = time.monotonic()
    with pytest.raises(RewardServerError, match=r"no reply within 0.2s \(--rm-timeout\) \(2 att"):
        asyncio.run(model(INP))
    assert time.monotonic() - start < 1.5  # two 0.2 s attempts, not the server's 2 s
    assert len(server.bodies) == 2


def test_no_server_is_a_connect_error(tmp_path):
    with pytest.raises(RewardServerError, match=r"--rm-url http://127.0.0.1:9/: .*cannot connect"):
        asyncio.run(remote(tmp_path, "http://127.0.0.1:9/", "--rm-max-retries", "0")(INP))
