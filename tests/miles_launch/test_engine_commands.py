"""SGLang, router and built-in engine command lines; registration with an external router."""

from __future__ import annotations

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

import pytest
from launch_testing import parse
from miles_launch.engine_launch.builtin_launcher import builtin_engine_command
from miles_launch.engine_launch.router import external_router_url, register_worker, router_command
from miles_launch.engine_launch.sglang_launcher import sglang_server_command


def test_sglang_command_line_with_passthrough(tmp_path):
    args = parse(
        tmp_path,
        "--rollout-engine", "sglang",
        "--rollout-num-gpus", "4",
        "--rollout-num-gpus-per-engine", "2",
        "--sglang-context-length", "32768",
        "--sglang-mem-fraction-static", "0.7",
        "--sglang-enable-dp-attention",
        "--sglang-dp-size", "2",
        "--sglang-cuda-graph-bs-decode", "1", "2", "4",
        "--sglang-log-level", "INFO",
    )  # fmt: skip
    cmd = sglang_server_command(args, host="10.0.0.5", port=30001, python="python")
    assert cmd == [
        "python", "-m", "sglang.launch_server",
        "--model-path", str(tmp_path / "hf"),
        "--tp-size", "2",
        "--host", "10.0.0.5",
        "--port", "30001",
        "--mem-fraction-static", "0.7",
        "--context-length", "32768",
        "--enable-dp-attention",
        "--dp-size", "2",
        "--cuda-graph-bs-decode", "1", "2", "4",
        "--log-level", "INFO",
    ]  # fmt: skip


def test_sglang_command_line_under_colocate(tmp_path):
    args = parse(tmp_path, "--colocate", "--rollout-engine", "sglang")
    cmd = sglang_server_command(args, host="h", port=1, python="python")
    assert cmd == [
        "python", "-m", "sglang.launch_server",
        "--model-path", str(tmp_path / "hf"),
        "--tp-size", "1",
        "--host", "h",
        "--port", "1",
        "--mem-fraction-static", "0.8",
        "--enable-memory-saver",
        "--cuda-graph-backend-prefill", "disabled",
    ]  # fmt: skip


def test_router_command_line_with_passthrough(tmp_path):
    args = parse(
        tmp_path,
        "--rollout-engine", "sglang",
        "--router-balance-abs-threshold", "0",
        "--router-policy", "cache_aware",
    )  # fmt: skip
    cmd = router_command(
        args,
        host="10.0.0.1",
        port=8000,
        worker_urls=["http://10.0.0.5:30001", "http://10.0.0.6:30001"],
        python="python",
    )
    assert cmd == [
        "python", "-m", "sglang_router.launch_router",
        "--host", "10.0.0.1",
        "--port", "8000",
        "--worker-urls", "http://10.0.0.5:30001", "http://10.0.0.6:30001",
        "--balance-abs-threshold", "0",
        "--policy", "cache_aware",
    ]  # fmt: skip
    # --sglang-router-ip/port are declared flags: never passed through, they name the router
    external = parse(
        tmp_path,
        "--rollout-engine", "sglang",
        "--sglang-router-ip", "10.0.0.9",
        "--sglang-router-port", "9000",
    )  # fmt: skip
    assert external.sglang_passthrough == {}
    assert external.router_passthrough == {}
    assert external_router_url(external) == "http://10.0.0.9:9000"


def test_builtin_engine_command_line(tmp_path):
    args = parse(tmp_path, "--rollout-engine", "builtin")
    cmd = builtin_engine_command(args, host="127.0.0.1", port=5, device="cpu", python="py")
    assert cmd == [
        "py", "-m", "miles_launch.builtin_engine",
        "--model-path", str(tmp_path / "hf"),
        "--host", "127.0.0.1",
        "--port", "5",
        "--device", "cpu",
    ]  # fmt: skip


class _Router(BaseHTTPRequestHandler):
    """A router stand-in that records registrations; ``new_api`` picks which route exists."""

    new_api = True
    seen: list = []

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/workers" and self.new_api:
            type(self).seen.append(("workers", json.loads(body)["url"]))
            self.send_response(202)
        elif self.path.startswith("/add_worker?url=") and not self.new_api:
            type(self).seen.append(("add_worker", self.path.split("=", 1)[1]))
            self.send_response(200)
        else:
            self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("new_api", [True, False])
def test_register_worker_with_external_router(new_api):
    handler = type("Router", (_Router,), {"new_api": new_api, "seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        register_worker(url, "http://10.0.0.5:30001")
    finally:
        server.shutdown()
    route = "workers" if new_api else "add_worker"
    expected = "http://10.0.0.5:30001" if new_api else "http%3A%2F%2F10.0.0.5%3A30001"
    assert handler.seen == [(route, expected)]


class _RemovingRouter(_Router):
    """Also removes workers: ``DELETE /workers/<url>`` (new API) or ``/remove_worker``."""

    def do_DELETE(self):  # noqa: N802
        if self.path.startswith("/workers/") and self.new_api:
            type(self).seen.append(("delete", unquote(self.path[len("/workers/") :])))
            self.send_response(202)
        else:
            self.send_response(404)
        self.end_headers()

    def do_POST(self):  # noqa: N802
        if self.path.startswith("/remove_worker?url=") and not self.new_api:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            type(self).seen.append(("remove_worker", unquote(self.path.split("=", 1)[1])))
            self.send_response(200)
            self.end_headers()
            return
        super().do_POST()


@contextlib.contextmanager
def behind_a_router(tmp_path, new_api: bool):
    """``(handler, engines)``: a stand-in router that also removes workers (``handler.seen``
    records its calls), and a job's SGLang :class:`EngineSet` pointed at it; stopped after."""
    from miles_launch.engine_launch.engine_set import EngineSet

    handler = type("Router", (_RemovingRouter,), {"new_api": new_api, "seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        args = parse(
            tmp_path,
            "--rollout-engine", "sglang",
            "--sglang-router-ip", "127.0.0.1",
            "--sglang-router-port", str(server.server_address[1]),
        )  # fmt: skip
        engines = EngineSet(args, placement=None)
        engines.router_url = external_router_url(args)
        yield handler, engines
    finally:
        server.shutdown()


@pytest.mark.parametrize("new_api", [True, False])
def test_engine_set_removes_its_workers_from_an_external_router_at_shutdown(tmp_path, new_api):
    """The engines this job registered leave the external router when the job stops (before,
    the router kept sending requests to stopped engines)."""
    with behind_a_router(tmp_path, new_api) as (handler, engines):
        for url in ("http://10.0.0.5:30001", "http://10.0.0.6:30001"):
            register_worker(engines.router_url, url)
            engines.registered.append(url)
        engines.shutdown()
    route, removal = ("workers", "delete") if new_api else ("add_worker", "remove_worker")
    assert [kind for kind, _ in handler.seen] == [route, route, removal, removal]
    assert [url for kind, url in handler.seen if kind == removal] == [
        "http://10.0.0.5:30001",
        "http://10.0.0.6:30001",
    ]
    assert engines.registered == []


def test_disk_delta_puller_command_sits_beside_its_engine(tmp_path):
    from miles_launch.engine_launch.engine_set import puller_command
    from miles_sync.cli import parse_pull_args

    shared = tmp_path / "shared"
    args = parse(
        tmp_path,
        "--rollout-engine", "builtin",
        "--update-weight-transfer-mode", "disk-delta",
        "--update-weight-disk-dir", str(shared),
        "--update-weight-local-checkpoint-dir", str(tmp_path / "local"),
    )  # fmt: skip
    cmd = puller_command(args, 1, "http://10.0.0.6:30001", python="py")
    assert cmd[:5] == ["py", "-m", "miles_sync.cli", "pull", "--update-weight-disk-dir"]
    pull = parse_pull_args(cmd[4:])  # the puller's own parser accepts it
    assert pull.update_weight_disk_dir == str(shared)
    assert pull.update_weight_local_checkpoint_dir == str(tmp_path / "local" / "engine-1-30001")
    assert pull.engine_url == "http://10.0.0.6:30001"


def test_a_restarted_engine_leaves_the_router_at_once_and_joins_after_its_publish(tmp_path):
    """SGLang behind a router: a dead engine is removed before its restart, and the restarted
    one (new port) is added only once a publish gave it the current weights."""
    with behind_a_router(tmp_path, new_api=True) as (handler, engines):
        engines.register("http://10.0.0.5:30001")
        engines.unregister("http://10.0.0.5:30001")  # restart: the dead one goes first
        engines.register("http://10.0.0.5:30002")  # after the publish to the new one
        engines.register("http://10.0.0.5:30002")  # once only
        assert engines.registered == ["http://10.0.0.5:30002"]
    assert handler.seen == [
        ("workers", "http://10.0.0.5:30001"),
        ("delete", "http://10.0.0.5:30001"),
        ("workers", "http://10.0.0.5:30002"),
    ]
