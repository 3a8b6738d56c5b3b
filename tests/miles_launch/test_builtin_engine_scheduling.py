"""The built-in engine over HTTP: pause (in place, retract, abort), continue, flush and
abort of running requests."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
from engine_testing import (
    generate,
    long_request,
    reference,
    wait_running,
)

# The modules share one engine subprocess (conftest.py), started by the first of them.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_blocks_new_requests_and_continue_releases(engine, models, mode):
    want = reference(models, "old", ("hello",), 150)[0]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(long_request, engine)
        wait_running(engine)
        assert engine.post("/pause_generation", {"mode": mode}).status_code == 200
        blocked = pool.submit(generate, engine, "ab", 4)
        time.sleep(0.5)
        assert not blocked.done() and not running.done()
        # in place, requests stay in the batch: flush is refused; retracted ones wait: allowed
        assert engine.post("/flush_cache").status_code == (400 if mode == "in_place" else 200)
        assert engine.post("/continue_generation").status_code == 200
        assert blocked.result(timeout=60)["output_ids"] == reference(models, "old", ("ab",), 4)[0]
        out = running.result(timeout=60)
    assert out["output_ids"] == want  # paused (and retracted) requests resume exactly
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 150}


def test_pause_abort_mode_aborts_running_requests(engine):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(long_request, engine, 400)
        wait_running(engine)
        assert engine.post("/pause_generation", {"mode": "abort"}).status_code == 200
        out = running.result(timeout=60)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) < 400
    assert engine.post("/continue_generation").status_code == 200


def test_flush_refused_while_running_then_accepted(engine):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(long_request, engine, 200)
        wait_running(engine)
        r = engine.post("/flush_cache")
        assert r.status_code == 400 and "running" in r.json()["error"]["message"]
        running.result(timeout=60)
    assert engine.client.get("/flush_cache").status_code == 200


def test_abort_request_by_rid_prefix(engine):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        victim = pool.submit(long_request, engine, 300, "victim-123")
        other = pool.submit(long_request, engine, 40, "other-1")
        wait_running(engine, 2)
        assert engine.post("/abort_request", {"rid": ""}).status_code == 200  # a no-op, as SGLang
        r = engine.post("/abort_request", {"rid": "victim"})
        assert r.status_code == 200
        assert victim.result(timeout=60)["meta_info"]["finish_reason"]["type"] == "abort"
        assert other.result(timeout=60)["meta_info"]["finish_reason"] == {
            "type": "length",
            "length": 40,
        }
