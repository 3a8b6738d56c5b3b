"""The publish round's HTTP traffic, seen by recording engines (httpx.MockTransport): which
calls each engine gets, in which order, and with which ``flush_cache``."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch
from miles_core.engine import EngineClient
from miles_sync.errors import PublishError
from miles_sync.ipc import IpcTransport
from miles_sync.publish import PublishRound
from miles_sync.ranks import RankContext


class RecordingEngine:
    """An engine that answers every call with success, except ``fail`` (a path), and records
    ``(path, body)`` per call."""

    def __init__(self, url: str, fail: str | None = None):
        self.calls: list[tuple[str, dict]] = []
        self.fail = fail
        self._lock = threading.Lock()
        self.client = EngineClient(url, retries=0, transport=httpx.MockTransport(self.handle))

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        with self._lock:
            self.calls.append((request.url.path, body))
        if request.url.path == self.fail:
            return httpx.Response(400, json={"success": False, "message": "refused by the test"})
        return httpx.Response(200, json={"success": True, "message": "ok"})

    def paths(self) -> list[str]:
        return [path for path, _ in self.calls]


def test_ipc_push_flushes_with_the_last_bucket_only():
    engine = RecordingEngine("http://engine-0")
    transport = IpcTransport(RankContext(), buffer_size=64, device=torch.device("cpu"))
    transport.connect([engine.client])
    source = [(f"w{i}", torch.full((16,), float(i))) for i in range(5)]  # 64 bytes each
    stats = transport.push(iter(source))
    transport.close()
    updates = [body for path, body in engine.calls if path == "/update_weights_from_tensor"]
    assert stats["buckets"] == len(updates) == 5
    assert [u["flush_cache"] for u in updates] == [False] * 4 + [True]
    assert all(u["load_format"] == "flattened_bucket" for u in updates)


def test_round_reaches_every_engine_in_order():
    engines = [RecordingEngine(f"http://engine-{i}") for i in range(3)]
    round_ = PublishRound([e.client for e in engines], version="7", pause_mode="retract")
    round_.open()
    round_.commit()
    assert round_.close() == []
    for engine in engines:
        assert engine.paths() == [
            "/pause_generation",
            "/flush_cache",
            "/begin_weight_update",
            "/update_weight_version",
            "/end_weight_update",
            "/continue_generation",
        ]
        assert engine.calls[0][1]["mode"] == "retract"
        assert engine.calls[3][1]["new_version"] == "7"


def test_a_failed_pause_names_the_engine_and_releases_the_others():
    engines = [RecordingEngine(f"http://engine-{i}") for i in range(3)]
    engines[1].fail = "/pause_generation"
    round_ = PublishRound([e.client for e in engines], version="2", pause_mode="abort")
    with pytest.raises(PublishError, match="pause_generation on http://engine-1 failed"):
        round_.open()
    round_.close()
    for i, engine in enumerate(engines):
        paused = i != 1
        # the engines that paused continue; none opened an update window
        assert engine.paths() == ["/pause_generation"] + (["/continue_generation"] * paused)


@pytest.mark.parametrize("failing", ["push", "/update_weight_version"])
def test_a_round_that_failed_after_opening_leaves_the_engines_paused(failing):
    """Buckets may have landed (a push failed, or the version change failed on one engine):
    every engine's update window is closed but none continues generation, so no decode step
    runs on a mix of two versions' weights."""
    engines = [RecordingEngine(f"http://engine-{i}") for i in range(3)]
    if failing != "push":
        engines[2].fail = failing
    round_ = PublishRound([e.client for e in engines], version="4", pause_mode="retract")
    round_.open()
    if failing != "push":  # (a failed push: the caller never commits)
        with pytest.raises(PublishError, match="update_weight_version on http://engine-2"):
            round_.commit()
    assert round_.close() == []
    assert [e.base_url for e in round_.held] == [e.client.base_url for e in engines]
    for engine in engines:
        assert engine.paths()[-1] == "/end_weight_update"
        assert "/continue_generation" not in engine.paths()
    retry = PublishRound([e.client for e in engines], version="4", pause_mode="retract")
    retry.open()  # a retry that completes resumes them
    for engine in engines:
        engine.fail = None
    retry.commit()
    retry.close()
    assert retry.held == []
    for engine in engines:
        assert engine.paths()[-1] == "/continue_generation"
