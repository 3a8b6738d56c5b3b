"""The built-in engine over HTTP: weight updates from tensors, disk and a gloo group, the
payload allowlist, memory release/resume, and updates racing running requests."""

from __future__ import annotations

import base64
import concurrent.futures
import os
import time

import pytest
import torch
from engine_testing import (
    assert_generates,
    free_port,
    generate,
    greedy_recompute,
    long_request,
    reference,
    serialize,
    wait_controls,
    wait_running,
)
from miles_sync.buckets import aligned_order, dumps_sglang_wire, pack_bucket, to_sglang_metadata

# The modules share one engine subprocess (conftest.py), started by the first of them.
pytestmark = pytest.mark.slow


def test_update_from_tensor_direct_and_flattened_bucket(engine, models):
    new_state = list(models["new"][1].state_dict().items())
    r = engine.post(
        "/update_weights_from_tensor",
        {"serialized_named_tensors": [serialize(new_state)], "weight_version": "t1"},
    )
    assert r.status_code == 200 and r.json()["success"], r.text
    assert_generates(engine, models, "new")
    assert engine.client.get("/get_model_info").json()["weight_version"] == "t1"
    # back to the old weights as one flattened bucket with SGLang's metadata class path, bf16 mixed in
    old_state = [(n, t.clone()) for n, t in models["old"][1].state_dict().items()]
    flat, meta = pack_bucket(old_state)
    payload = base64.b64encode(
        dumps_sglang_wire({"flattened_tensor": flat, "metadata": to_sglang_metadata(meta)})
    )
    r = engine.post(
        "/update_weights_from_tensor",
        {
            "serialized_named_tensors": [payload.decode()],
            "load_format": "flattened_bucket",
            "weight_version": "default",
        },
    )
    assert r.status_code == 200, r.text
    assert_generates(engine, models, "old")


def test_update_from_disk(engine, models):
    r = engine.post(
        "/update_weights_from_disk", {"model_path": str(models["new"][0]), "weight_version": "d1"}
    )
    assert r.status_code == 200 and r.json()["success"], r.text
    assert_generates(engine, models, "new")
    assert (
        engine.post("/update_weights_from_disk", {"model_path": str(models["old"][0])}).status_code
        == 200
    )
    assert_generates(engine, models, "old")
    r = engine.post("/update_weights_from_disk", {"model_path": "/nonexistent/dir"})
    assert (
        r.status_code == 400
        and r.json()["success"] is False
        and "/nonexistent/dir" in r.json()["message"]
    )


def test_update_from_distributed_gloo(engine, models):
    """The test process is rank 0 and hosts the TCPStore, as the trainer does."""
    import torch.distributed as dist
    from miles_launch.builtin_engine.weights import join_weight_update_group

    port = free_port()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        joined = pool.submit(
            engine.post,
            "/init_weights_update_group",
            {
                "master_address": "127.0.0.1",
                "master_port": port,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": "wu",
                "backend": "gloo",
            },
        )
        pg = join_weight_update_group("127.0.0.1", port, 0, 2, "wu", "gloo", is_master=True)
        assert joined.result(timeout=60).status_code == 200
        for which, fmt in (("new", None), ("old", "flattened_bucket")):
            named = list(models[which][1].state_dict().items())
            if fmt == "flattened_bucket":  # names in the bucket's order
                named = aligned_order(named)
            body = {
                "names": [n for n, _ in named],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
                "shapes": [list(t.shape) for _, t in named],
                "group_name": "wu",
                "load_format": fmt,
                "weight_version": f"dist-{which}",
            }
            reply = pool.submit(engine.post, "/update_weights_from_distributed", body)
            if fmt is None:
                for _, t in named:
                    dist.broadcast(t.contiguous(), src=0, group=pg)
            else:
                flat, _ = pack_bucket(named)
                dist.broadcast(flat, src=0, group=pg)
            assert reply.result(timeout=60).status_code == 200
            assert_generates(engine, models, which)
        # a bucket whose last tensor the model lacks: the broadcast is still received (the
        # trainer does not hang), then the call is refused naming it and nothing is loaded
        named = list(models["new"][1].state_dict().items())
        named[-1] = ("model.no_such.weight", named[-1][1])
        body = {
            "names": [n for n, _ in named],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named],
            "group_name": "wu",
            "load_format": "flattened_bucket",
            "weight_version": "must-not-appear",
        }
        reply = pool.submit(engine.post, "/update_weights_from_distributed", body)
        dist.broadcast(pack_bucket(named)[0], src=0, group=pg)
        r = reply.result(timeout=60)
        assert r.status_code == 400 and "model.no_such.weight" in r.json()["message"], r.text
        assert engine.client.get("/get_model_info").json()["weight_version"] == "dist-old"
        assert_generates(engine, models, "old")
    assert engine.post("/destroy_weights_update_group", {"group_name": "wu"}).status_code == 200
    dist.destroy_process_group(pg)


def test_unsafe_payload_is_refused(engine, models, tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    r = engine.post(
        "/update_weights_from_tensor", {"serialized_named_tensors": [serialize([("x", Evil())])]}
    )
    assert r.status_code == 400 and "not on the allowlist" in r.json()["error"]["message"]
    assert "system" in r.json()["message"]
    time.sleep(0.2)
    assert not marker.exists()
    assert_generates(engine, models, "old")


def test_memory_release_and_resume(engine, models):
    before = engine.client.get("/get_server_info").json()["memory"]["weights_bytes"]
    assert before > 0
    assert (
        engine.post("/release_memory_occupation", {"tags": ["weights", "kv_cache"]}).status_code
        == 200
    )
    assert engine.client.get("/get_server_info").json()["memory"] == {
        "weights_bytes": 0,
        "kv_cache_bytes": 0,
    }
    out = generate(engine, "a", 3)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert engine.post("/resume_memory_occupation", {}).status_code == 200
    assert engine.client.get("/get_server_info").json()["memory"]["weights_bytes"] == before
    assert_generates(engine, models, "old")  # restored from the CPU backup
    assert engine.post("/release_memory_occupation", {"tags": ["bogus"]}).status_code == 400


def test_weight_update_window_once_begin_end_is_used(engine, models):
    state = list(models["old"][1].state_dict().items())
    body = {"serialized_named_tensors": [serialize(state)]}
    assert engine.post("/begin_weight_update", {"selector": "all"}).status_code == 200
    assert engine.post("/update_weights_from_tensor", body).status_code == 200
    assert engine.post("/end_weight_update").status_code == 200
    r = engine.post("/update_weights_from_tensor", body)
    assert r.status_code == 400 and "begin_weight_update" in r.json()["error"]["message"]
    r = engine.post("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []})
    assert r.status_code == 400 and "begin_weight_update" in r.json()["error"]["message"]


def test_weight_update_waits_for_inflight_requests(engine, models):
    """An update on an unpaused server lets running requests finish on the old weights; a
    request arriving while the update waits is held back and runs on the new weights."""
    want = reference(models, "old", ("hello",), 150)[0]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        running = pool.submit(long_request, engine)
        wait_running(engine)
        assert engine.post("/begin_weight_update").status_code == 200
        update = pool.submit(
            engine.post, "/update_weights_from_disk", {"model_path": str(models["new"][0])}
        )
        wait_controls(engine)  # the update waits for the running request
        late = pool.submit(generate, engine, ("ab",), 4)
        assert update.result(timeout=60).status_code == 200
        assert (
            running.result(timeout=60)["output_ids"] == want
        )  # not one token from the new weights
        assert [o["output_ids"] for o in late.result(timeout=60)] == reference(
            models, "new", ("ab",), 4
        )
    assert_generates(engine, models, "new")
    assert (
        engine.post("/update_weights_from_disk", {"model_path": str(models["old"][0])}).status_code
        == 200
    )
    assert engine.post("/end_weight_update").status_code == 200


def test_retract_update_continue_switches_weights_mid_request(engine, models):
    """The RL step: pause (retract), load new weights, continue. The retracted request keeps
    its tokens so far (old weights) and continues from a recomputed prefix on the new ones."""
    tok, new_model = models["tokenizer"], models["new"][1]
    old = reference(models, "old", ("hello",), 150)[0]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(long_request, engine)
        wait_running(engine)
        # Pause at once: on a loaded machine a delay lets the 150 tokens finish first. Any
        # switch point k < 150 (0 included) checks the same thing.
        assert engine.post("/pause_generation", {"mode": "retract"}).status_code == 200
        r = engine.post("/update_weights_from_disk", {"model_path": str(models["new"][0])})
        assert r.status_code == 200
        assert engine.post("/continue_generation").status_code == 200
        out = running.result(timeout=60)["output_ids"]
    assert len(out) == 150
    k = next((i for i, (a, b) in enumerate(zip(out, old)) if a != b), len(out))
    assert k < 150  # the new weights took over before the end
    prompt = tok.encode("hello")
    assert out[k:] == greedy_recompute(new_model, prompt + out[:k], 150 - k)
    assert (
        engine.post("/update_weights_from_disk", {"model_path": str(models["old"][0])}).status_code
        == 200
    )


def test_a_bad_tensor_anywhere_leaves_model_and_version_unchanged(engine, models):
    """Names, shapes and dtype kinds are checked before any byte is loaded: an update whose
    last tensor does not fit loads none of the others, and the weight version stays."""
    assert engine.post("/begin_weight_update").status_code == 200  # wrapped, as SGLang wants
    version = engine.client.get("/get_model_info").json()["weight_version"]
    new_state = list(models["new"][1].state_dict().items())
    name, tensor = new_state[-1]
    for bad, word in (
        ((name, tensor.t().contiguous() if tensor.dim() == 2 else tensor[:1]), f"{name}: shape"),
        ((name, tensor.to(torch.int64)), f"{name}: dtype int64"),
        (("model.no_such.weight", tensor), "no parameter or buffer named 'model.no_such.weight'"),
    ):
        body = {
            "serialized_named_tensors": [serialize(new_state[:-1] + [bad])],
            "weight_version": "must-not-appear",
        }
        r = engine.post("/update_weights_from_tensor", body)
        assert r.status_code == 400 and r.json()["success"] is False, r.text
        assert word in r.json()["message"]
        assert engine.client.get("/get_model_info").json()["weight_version"] == version
        assert_generates(engine, models, "old")
    # fp32 masters into the engine's weights are loaded (a float -> float cast)
    r = engine.post(
        "/update_weights_from_tensor",
        {"serialized_named_tensors": [serialize([(n, t.double()) for n, t in new_state])]},
    )
    assert r.status_code == 200, r.text
    assert_generates(engine, models, "new")
    state = list(models["old"][1].state_dict().items())
    assert (
        engine.post(
            "/update_weights_from_tensor", {"serialized_named_tensors": [serialize(state)]}
        ).status_code
        == 200
    )
    assert engine.post("/end_weight_update").status_code == 200


def test_fd_passing_payload_is_refused_over_http(engine, models):
    """torch's file_descriptor strategy passes an fd (DupFd): refused, 400 naming it."""
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as mp

    mp.set_sharing_strategy("file_descriptor")
    try:
        buf = io.BytesIO()
        ForkingPickler(buf).dump([("model.norm.weight", torch.zeros(32))])
        payload = base64.b64encode(buf.getvalue()).decode()
    finally:
        mp.set_sharing_strategy("file_system")
    assert engine.post("/begin_weight_update").status_code == 200
    r = engine.post("/update_weights_from_tensor", {"serialized_named_tensors": [payload]})
    assert engine.post("/end_weight_update").status_code == 200
    assert r.status_code == 400, r.text
    assert "rebuild_storage_fd is not on the allowlist" in r.json()["message"]
    assert_generates(engine, models, "old")


def test_get_weights_by_name_reads_back_what_was_loaded(engine, models):
    """SGLang's ``/get_weights_by_name``: the first rows of a tensor, exact in float32, so a
    caller can compare an engine's weights with the trainer's bit for bit."""
    new_state = dict(models["new"][1].state_dict())
    assert engine.post("/begin_weight_update", {"selector": "all"}).status_code == 200
    r = engine.post(
        "/update_weights_from_tensor",
        {"serialized_named_tensors": [serialize(list(new_state.items()))]},
    )
    assert r.status_code == 200, r.text
    assert engine.post("/end_weight_update", {}).status_code == 200
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        got = engine.post("/get_weights_by_name", {"name": name, "truncate_size": 3})
        assert got.status_code == 200, got.text
        want = new_state[name][:3].float()
        assert torch.equal(torch.tensor(got.json(), dtype=torch.float32), want)
    bad = engine.post("/get_weights_by_name", {"name": "model.no_such.weight"})
    assert bad.status_code == 400 and "model.no_such.weight" in bad.json()["error"]["message"]
    assert engine.post("/get_weights_by_name", {"name": 3}).status_code == 400
    zero = engine.post("/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 0})
    assert zero.status_code == 400
    assert engine.post("/begin_weight_update", {"selector": "all"}).status_code == 200
    r = engine.post("/update_weights_from_disk", {"model_path": str(models["old"][0])})
    assert r.status_code == 200, r.text
    assert engine.post("/end_weight_update", {}).status_code == 200
