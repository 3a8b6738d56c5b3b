"""One API key for the engine control plane: --sglang-api-key reaches every engine and router
miles starts and every client of ours; a key is generated for the job when engines bind a
non-loopback address; it is never logged in full; the built-in engine bound to a non-loopback
address without a key refuses the endpoints that change its model."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from launch_testing import parse
from miles_launch.engine_launch.api_key import (
    API_KEY_ENV,
    ensure_api_key,
    redact,
    redact_argv,
)
from miles_launch.engine_launch.builtin_launcher import builtin_engine_command, builtin_engine_env
from miles_launch.engine_launch.engine_set import EngineSet
from miles_launch.engine_launch.process import SECRET_FILE, ProcessHost
from miles_launch.engine_launch.router import register_worker, router_command
from miles_launch.engine_launch.sglang_launcher import sglang_secret_config, sglang_server_command

KEY = "k3y-0123456789abcdef"


def test_the_key_reaches_sglang_the_router_and_the_builtin_engine(tmp_path):
    args = parse(tmp_path, "--rollout-engine", "sglang", "--sglang-api-key", KEY)
    assert args.sglang_passthrough == {}  # a declared flag: one source, not passed through
    cmd = sglang_server_command(args, host="10.0.0.5", port=1, python="python")
    assert KEY not in " ".join(cmd) and "--api-key" not in cmd  # not in the process list
    assert cmd[cmd.index("--config") + 1] == SECRET_FILE  # the engine host's private file
    assert sglang_secret_config(args) == f'api-key: "{KEY}"\n'
    assert sglang_secret_config(parse(tmp_path, "--rollout-engine", "sglang")) is None
    router = router_command(args, host="h", port=2, worker_urls=["http://w:1"], python="python")
    assert router[router.index("--api-key") + 1] == KEY
    builtin = parse(
        tmp_path, "--rollout-engine", "builtin", "--sglang-api-key", KEY,
        "--sglang-context-length", "64",
    )  # fmt: skip
    cmd = builtin_engine_command(builtin, host="10.0.0.5", port=1, device="cpu", python="py")
    assert KEY not in " ".join(cmd)  # not in the process list
    assert cmd[cmd.index("--context-length") + 1] == "64"
    assert builtin_engine_env(builtin) == {API_KEY_ENV: KEY}
    assert builtin_engine_env(parse(tmp_path, "--rollout-engine", "builtin")) == {}


def test_every_client_of_ours_sends_it(tmp_path):
    from miles_launch.rollout.generate import Generator
    from miles_sync.weight_sync import SyncConfig

    args = parse(tmp_path, "--rollout-engine", "builtin", "--sglang-api-key", KEY)
    engines = EngineSet(args, placement=None)
    with engines.client("http://127.0.0.1:1") as client:
        assert client.headers()["Authorization"] == f"Bearer {KEY}"
    gen = Generator(["http://127.0.0.1:1"], None, None, api_key=engines.api_key)
    assert gen.clients[0].headers()["Authorization"] == f"Bearer {KEY}"
    asyncio.run(gen.clients[0].aclose())
    assert SyncConfig.from_args(args).engine_api_key == KEY  # the trainer's publisher


def test_a_key_is_generated_only_when_engines_leave_loopback(tmp_path, caplog):
    args = parse(tmp_path)
    assert ensure_api_key(args, "127.0.0.1") is None and args.sglang_api_key is None
    with caplog.at_level(logging.INFO):
        key = ensure_api_key(args, "10.1.2.3")
    assert key and len(key) >= 32 and args.sglang_api_key == key
    assert key not in caplog.text and redact(key) in caplog.text
    assert ensure_api_key(args, "10.1.2.3") == key  # stable for the job
    given = parse(tmp_path, "--sglang-api-key", KEY)
    assert ensure_api_key(given, "10.1.2.3") == KEY


def test_the_key_is_masked_in_logged_command_lines(tmp_path):
    assert redact_argv(["x", "--api-key", KEY, "--api-key=" + KEY]) == [
        "x", "--api-key", redact(KEY), "--api-key=" + redact(KEY),
    ]  # fmt: skip
    host = ProcessHost("engine-0", log_dir=str(tmp_path))
    host.start(["true", "--api-key", KEY], {})
    host.process.wait(10)
    log = (tmp_path / "engine-0.log").read_text()
    assert "--api-key" in log and KEY not in log


class _Router(BaseHTTPRequestHandler):
    seen: list = []

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        type(self).seen.append((self.headers.get("Authorization"), json.loads(body)))
        self.send_response(202)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_router_registration_carries_the_key():
    handler = type("Router", (_Router,), {"seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        register_worker(f"http://127.0.0.1:{server.server_address[1]}", "http://w:1", KEY)
    finally:
        server.shutdown()
    assert handler.seen == [(f"Bearer {KEY}", {"url": "http://w:1", "api_key": KEY})]


# ---- the built-in engine's gate ---------------------------------------------------------------
def _app(host: str, api_key: str | None):
    from fastapi.testclient import TestClient
    from miles_launch.builtin_engine.server import EngineConfig, EngineState, build_app

    config = EngineConfig(model_path="m", tokenizer_path="m", host=host, api_key=api_key)
    state = EngineState(
        config=config,
        tokenizer=None,
        scheduler=SimpleNamespace(),
        weights=None,
        weight_version="v0",
        vocab_size=8,
        context_length=8,
    )
    client = TestClient(build_app(state))
    client.state = state
    return client


@pytest.mark.parametrize(
    "path",
    [
        "/update_weights_from_tensor",
        "/update_weights_from_disk",
        "/update_weights_from_distributed",
        "/init_weights_update_group",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/update_weight_version",
        "/destroy_weights_update_group",
        "/begin_weight_update",
        "/end_weight_update",
        "/pause_generation",
        "/continue_generation",
        "/abort_request",
        "/flush_cache",
        "/get_weights_by_name",
    ],
)
def test_builtin_engine_on_the_network_without_a_key_refuses_model_changes(path):
    with _app("0.0.0.0", None) as client:
        r = client.post(path, json={})
        assert r.status_code == 403 and "without --api-key" in r.json()["error"]["message"]
        assert r.json()["success"] is False
        assert client.get("/get_model_info").status_code == 200  # reading is fine
    with _app("127.0.0.1", None) as client:  # loopback: local use needs no key
        assert client.post(path, content=b"").status_code == 400  # reached the handler


def test_builtin_engine_with_a_key_wants_it_on_every_endpoint_but_health():
    with _app("0.0.0.0", KEY) as client:
        assert client.get("/get_model_info").status_code == 401
        assert client.post("/update_weights_from_disk", json={}).status_code == 401
        wrong = {"Authorization": "Bearer " + KEY[:-1]}
        assert client.get("/get_model_info", headers=wrong).status_code == 401
        ok = {"Authorization": f"Bearer {KEY}"}
        assert client.get("/get_model_info", headers=ok).json()["weight_version"] == "v0"
        for scheme in ("bearer", "BEARER"):  # SGLang compares the scheme in any case
            lower = {"Authorization": f"{scheme} {KEY}"}
            assert client.get("/get_model_info", headers=lower).status_code == 200
        for bad in (f"Basic {KEY}", f"Bearer  {KEY}", f"Bearer{KEY}"):
            assert client.get("/get_model_info", headers={"Authorization": bad}).status_code == 401
        r = client.post("/update_weights_from_disk", json={}, headers=ok)
        assert r.status_code == 400 and "model_path" in r.json()["message"]


def test_every_route_that_changes_state_or_reads_weights_is_protected():
    """The protected list is the app's own: every POST route but /generate, and the weight
    reader, are in it (a route added later without protection fails here)."""
    from miles_launch.builtin_engine.server import PROTECTED_PATHS

    with _app("127.0.0.1", None) as client:
        routes = client.app.routes
    posts = {r.path for r in routes if "POST" in getattr(r, "methods", ())}
    assert posts - {"/generate"} <= PROTECTED_PATHS
    assert "/get_weights_by_name" in PROTECTED_PATHS


def test_the_builtin_engine_refuses_to_start_on_the_network_without_a_key(monkeypatch, capsys):
    from miles_launch.builtin_engine.__main__ import main

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["--model-path", "/nonexistent", "--host", "0.0.0.0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--api-key" in err and API_KEY_ENV in err, err
    monkeypatch.setenv(API_KEY_ENV, KEY)
    from miles_launch.builtin_engine.__main__ import parse_args

    assert parse_args(["--model-path", "m", "--host", "0.0.0.0"]).api_key == KEY
    monkeypatch.delenv(API_KEY_ENV)
    assert parse_args(["--model-path", "m", "--host", "localhost"]).api_key is None


def test_a_paused_engine_exits_when_told_to(monkeypatch):
    """SIGTERM sets uvicorn's should_exit; a paused engine holds /generate requests open,
    and uvicorn waited for them forever. It now cancels them after a grace period."""
    import threading
    import time

    import httpx
    import uvicorn
    from engine_testing import free_port
    from miles_launch.builtin_engine import __main__ as engine_main

    monkeypatch.setattr(engine_main, "GRACEFUL_SHUTDOWN_S", 0.5)
    client = _app("127.0.0.1", None)
    app, state = client.app, client.state
    state.gate.clear()  # what /pause_generation does before it reaches the scheduler
    config = SimpleNamespace(host="127.0.0.1", port=free_port())
    server = uvicorn.Server(engine_main.server_config(app, config))
    serving = threading.Thread(target=server.run, daemon=True)
    serving.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    url = f"http://127.0.0.1:{config.port}/generate"
    waiting = threading.Thread(target=lambda: httpx.post(url, json=body, timeout=30), daemon=True)
    waiting.start()
    time.sleep(0.5)
    assert waiting.is_alive()  # held at the paused gate
    started = time.monotonic()
    server.should_exit = True
    serving.join(timeout=15)
    assert not serving.is_alive() and time.monotonic() - started < 10


def test_the_engine_host_writes_the_secret_file_private_and_removes_it(tmp_path):
    """The host puts the secret in a 0600 file (0700 directory) on its node, passes its path
    where the command names SECRET_FILE, and removes it when it stops the process."""
    import stat
    import sys

    host = ProcessHost("engine-0", log_dir=str(tmp_path))
    script = "import sys, time; print(open(sys.argv[2]).read(), flush=True); time.sleep(60)"
    host.start([sys.executable, "-c", script, "--config", SECRET_FILE], {}, secret="api-key: x\n")
    path = host.secret_path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert path.read_text() == "api-key: x\n"
    assert str(path) in host.process.args and SECRET_FILE not in host.process.args
    log = tmp_path / "engine-0.log"
    deadline = time.monotonic() + 60
    while "api-key: x" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)  # until the child has read the file (a state, not a delay)
    assert "api-key: x" in log.read_text()
    host.stop()
    assert not path.exists() and not path.parent.exists()
