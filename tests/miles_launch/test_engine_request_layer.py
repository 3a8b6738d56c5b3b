"""The built-in engine's request layer: bodies parsed as SGLang parses them ("false" is False),
SGLang's answers where a client can tell (empty input_ids, the context rule), and one
exception boundary per route: a malformed payload is a 400 naming the field, never a 500, and
nothing of it outlives the request."""

from __future__ import annotations

import concurrent.futures
import gc
import weakref

import pytest
import torch
from engine_testing import assert_generates, long_request, serialize, wait_running
from miles_sync.buckets import pack_bucket

pytestmark = pytest.mark.slow


def test_false_means_false(engine):
    """The issue's case: {"abort_all": "false"} aborted every running request."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(long_request, engine, 120)
        wait_running(engine)
        r = engine.post("/abort_request", {"abort_all": "false"})
        assert r.status_code == 200 and "ignored" in r.json()["message"], r.text
        r = engine.post(
            "/update_weight_version", {"new_version": "v-f", "abort_all_requests": "false"}
        )
        assert r.status_code == 200, r.text
        out = running.result(timeout=60)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 120}
    assert engine.post("/update_weight_version", {"new_version": "default"}).status_code == 200


@pytest.mark.parametrize(
    "path,body,field",
    [
        ("/abort_request", {"abort_all": "maybe"}, "abort_all"),
        ("/abort_request", {"rid": 5}, "rid"),
        ("/update_weight_version", {"new_version": 5}, "new_version"),
        ("/pause_generation", {"mode": "later"}, "mode"),
        ("/update_weights_from_disk", {}, "model_path"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["%%"]}, "serialized_named"),
        ("/init_weights_update_group", {"master_address": "h"}, "master_port"),
        ("/get_weights_by_name", {"name": "w", "truncate_size": "ten"}, "truncate_size"),
        ("/release_memory_occupation", {"tags": "weights"}, "tags"),
    ],
)
def test_a_body_sglang_refuses_is_a_400_naming_the_field(engine, path, body, field):
    r = engine.post(path, body)
    assert r.status_code == 400, r.text
    assert f"field {field}" in r.json()["error"]["message"], r.text


def test_sglangs_answers_to_empty_input_and_to_a_request_that_fills_the_context(engine):
    r = engine.post("/generate", {"input_ids": [], "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and r.json()["error"]["message"] == "input_ids cannot be empty."
    # 500 input tokens + 12 new = the context (512): SGLang serves it, only > is refused
    body = {"input_ids": [5] * 500, "sampling_params": {"max_new_tokens": 12, "ignore_eos": True}}
    r = engine.post("/generate", body)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    body["sampling_params"]["max_new_tokens"] = 13
    assert engine.post("/generate", body).status_code == 400


def _bucket_without(field: str) -> str:
    flat, meta = pack_bucket([("model.norm.weight", torch.ones(32))])
    delattr(meta[0], field)
    return serialize({"flattened_tensor": flat, "metadata": meta})


def test_bucket_metadata_without_a_field_is_a_400_and_the_engine_serves_on(engine, models):
    """The issue's engine kill: AttributeError in the weight checks, a 500 and a reset."""
    version = engine.client.get("/get_model_info").json()["weight_version"]
    assert engine.post("/begin_weight_update").status_code == 200  # (another test used one)
    r = engine.post(
        "/update_weights_from_tensor",
        {"serialized_named_tensors": [_bucket_without("shape")], "load_format": "flattened_bucket"},
    )
    assert engine.post("/end_weight_update").status_code == 200
    assert r.status_code == 400 and r.json()["success"] is False, r.text
    assert "metadata[0]: missing field(s) ['shape']" in r.json()["message"]
    assert engine.client.get("/health").status_code == 200
    assert engine.client.get("/get_model_info").json()["weight_version"] == version
    assert_generates(engine, models, "old")


# ---- in process: what a failed request leaves behind --------------------------------------
@pytest.fixture
def app_client(models):
    from fastapi.testclient import TestClient
    from miles_launch.builtin_engine.scheduler import Scheduler
    from miles_launch.builtin_engine.server import EngineConfig, EngineState, build_app
    from miles_launch.builtin_engine.weights import WeightStore

    model = models["old"][1]
    sched = Scheduler(model, models["tokenizer"], torch.device("cpu"))
    sched.start()
    state = EngineState(
        config=EngineConfig(model_path="m", tokenizer_path="m"),
        tokenizer=models["tokenizer"],
        scheduler=sched,
        weights=WeightStore(model, torch.device("cpu")),
        weight_version="v0",
        vocab_size=64,
        context_length=512,
    )
    with TestClient(build_app(state), raise_server_exceptions=False) as client:
        yield client
    sched.shutdown()


def test_nothing_of_a_failed_payload_outlives_its_request(app_client, monkeypatch):
    """A storage kept alive by a failed request's traceback outlived the sender's shared-memory
    manager and killed the engine. With the cycle collector off, every tensor a failed request
    decoded is gone once its answer is back: failed in the checks before the scheduler (a
    bucket missing a field) and on the scheduler thread (a shape that does not fit)."""
    from miles_launch.builtin_engine.safe_unpickle import AllowlistUnpickler

    decoded = []
    real = AllowlistUnpickler._rebuild_tensor

    def recording(self, *args):
        tensor = real(self, *args)
        decoded.append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(AllowlistUnpickler, "_rebuild_tensor", recording)
    wrong_shape = serialize([("model.norm.weight", torch.ones(5))])
    bodies = [
        {"serialized_named_tensors": [_bucket_without("dtype")], "load_format": "flattened_bucket"},
        {"serialized_named_tensors": [wrong_shape]},
    ]
    gc.collect()
    gc.disable()
    try:
        for body in bodies:
            decoded.clear()
            r = app_client.post("/update_weights_from_tensor", json=body)
            assert r.status_code == 400, r.text
            assert decoded and all(ref() is None for ref in decoded), r.json()["message"]
    finally:
        gc.enable()
    assert "shape (5,)" in r.json()["message"]


def test_any_error_in_a_route_is_a_4xx_not_a_500(app_client, monkeypatch):
    """An error nobody foresaw (here: the weight store raising KeyError) still stays with its
    request: 400 naming the route and the error, and the engine answers the next request."""
    from miles_launch.builtin_engine.weights import WeightStore

    def broken(self, name):
        raise KeyError(name)

    monkeypatch.setattr(WeightStore, "resolve", broken)
    r = app_client.post("/get_weights_by_name", json={"name": "model.norm.weight"})
    assert r.status_code == 400 and "KeyError" in r.json()["error"]["message"], r.text
    r = app_client.post("/update_weights_from_disk", json={"model_path": "/nonexistent"})
    assert r.status_code == 400 and r.json()["success"] is False
    assert app_client.get("/health").status_code in (200, 503)
