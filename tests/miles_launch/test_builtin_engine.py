"""The built-in engine over HTTP (httpx), against transformers references.

One server (module scope) serves a tiny Qwen3 saved to disk; a second set of weights (another
seed) is the "new" model for the weight-update tests, which restore the first afterwards.
"""

from __future__ import annotations

import base64
import concurrent.futures
import os
import time

import pytest
import torch
from engine_testing import (
    EngineProcess,
    free_port,
    greedy_recompute,
    hf_greedy,
    save_tokenizer,
    serialize,
    tiny_qwen3,
)
from miles_sync.buckets import dumps_sglang_wire, pack_bucket, to_sglang_metadata

# Each module starts an engine subprocess (torch + transformers import, model load).
pytestmark = pytest.mark.slow

PROMPTS = ["hello world", "ab", "the quick brown fox jumps", "0123"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    tokenizer = None
    out = {}
    for name, seed in (("old", 0), ("new", 1)):
        model = tiny_qwen3(seed)
        model.save_pretrained(root / name)
        tokenizer = save_tokenizer(root / name)
        out[name] = (root / name, model)
    out["tokenizer"] = tokenizer
    out["references"] = {}
    return out


@pytest.fixture(scope="module")
def engine(models):
    server = EngineProcess(
        models["old"][0], "--enable-weights-cpu-backup", "--max-running-requests", "3"
    )
    yield server
    server.close()


@pytest.fixture(autouse=True)
def _unpaused(engine):
    """A failed pause test must not leave the shared server paused for the next ones."""
    yield
    engine.post("/continue_generation")


def generate(engine, prompt, max_new_tokens=16, **extra):
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
    params.update(extra.pop("sampling_params", {}))
    r = engine.post("/generate", {"text": prompt, "sampling_params": params, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def reference(models, which, prompts=tuple(PROMPTS), max_new_tokens=16):
    """transformers' greedy generations (memoised per module)."""
    key = (which, tuple(prompts), max_new_tokens)
    if key not in models["references"]:
        tok, model = models["tokenizer"], models[which][1]
        models["references"][key] = [
            hf_greedy(model, tok.encode(p), max_new_tokens) for p in prompts
        ]
    return models["references"][key]


# ---- generation --------------------------------------------------------------------------
def test_greedy_batch_equals_model_generate_and_is_deterministic(engine, models):
    want = reference(models, "old")
    first = generate(engine, PROMPTS)
    assert isinstance(first, list) and len(first) == len(PROMPTS)
    assert [o["output_ids"] for o in first] == want
    assert [o["output_ids"] for o in generate(engine, PROMPTS)] == want
    tok = models["tokenizer"]
    for out, ids, prompt in zip(first, want, PROMPTS):
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(tok.encode(prompt))
        assert meta["completion_tokens"] == len(ids)
        assert meta["weight_version"] == "default"
        if ids[-1] == 0:  # EOS: kept in output_ids, not in text
            assert meta["finish_reason"] == {"type": "stop", "matched": 0}
            assert out["text"] == tok.decode(ids[:-1])
        else:
            assert meta["finish_reason"] == {"type": "length", "length": 16}
            assert out["text"] == tok.decode(ids)


def test_requests_joining_and_leaving_a_running_batch(engine, models):
    """Staggered requests of different lengths (max 3 running): each equals its reference."""
    prompts = PROMPTS * 2
    lengths = [5, 23, 9, 31, 2, 17, 12, 27]
    tok, model = models["tokenizer"], models["old"][1]
    want = [hf_greedy(model, tok.encode(p), n) for p, n in zip(prompts, lengths)]

    def one(i):
        time.sleep(0.03 * i)
        body = {
            "input_ids": tok.encode(prompts[i]),
            "sampling_params": {"max_new_tokens": lengths[i], "temperature": 0},
        }
        return engine.post("/generate", body).json()["output_ids"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, range(len(prompts))))
    assert got == want


def test_logprobs_equal_a_forward_pass(engine, models):
    tok, model = models["tokenizer"], models["old"][1]
    prompt_ids = tok.encode("the quick brown fox")
    out = engine.post(
        "/generate",
        {
            "input_ids": prompt_ids,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0},
            "return_logprob": True,
        },
    ).json()
    lps = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"] and all(x is None for _, _, x in lps)
    seq = torch.tensor([prompt_ids + out["output_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(seq).logits[0].double(), dim=-1)
    n = len(prompt_ids)
    want = [logp[n - 1 + i, tok_id].item() for i, tok_id in enumerate(out["output_ids"])]
    assert max(abs(a - b) for (a, _, _), b in zip(lps, want)) < 1e-5


def test_sampling_semantics(engine, models):
    greedy = generate(engine, "hello", 10)["output_ids"]
    # top_k = 1 at a high temperature is greedy
    assert (
        generate(engine, "hello", 10, sampling_params={"temperature": 5.0, "top_k": 1})[
            "output_ids"
        ]
        == greedy
    )
    # a tiny top_p keeps only the most likely token
    assert (
        generate(engine, "hello", 10, sampling_params={"temperature": 5.0, "top_p": 1e-6})[
            "output_ids"
        ]
        == greedy
    )
    # min_p = 1 keeps only the maximum
    assert (
        generate(engine, "hello", 10, sampling_params={"temperature": 5.0, "min_p": 1.0})[
            "output_ids"
        ]
        == greedy
    )
    seeded = {"temperature": 1.5, "sampling_seed": 7, "ignore_eos": True}
    a = generate(engine, "hello", 20, sampling_params=seeded)["output_ids"]
    assert generate(engine, "hello", 20, sampling_params=seeded)["output_ids"] == a
    many = generate(
        engine, "hello", 20, sampling_params={"temperature": 1.5, "n": 3, "ignore_eos": True}
    )
    assert (
        isinstance(many, list) and len(many) == 3 and all(len(o["output_ids"]) == 20 for o in many)
    )
    assert len({tuple(o["output_ids"]) for o in many}) > 1


def test_stop_strings_and_stop_token_ids(engine, models):
    tok = models["tokenizer"]
    full = generate(engine, "hello world", 30, sampling_params={"ignore_eos": True})
    text = full["text"]
    stop = text[5:7]
    cut = text.find(stop)
    out = generate(engine, "hello world", 30, sampling_params={"ignore_eos": True, "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[:cut]
    assert out["output_ids"] == full["output_ids"][: len(out["output_ids"])]
    kept = generate(
        engine,
        "hello world",
        30,
        sampling_params={"ignore_eos": True, "stop": stop, "no_stop_trim": True},
    )
    assert kept["text"].endswith(stop) and kept["text"].startswith(text[:cut])
    stop_id = full["output_ids"][3]
    out = generate(
        engine, "hello world", 30, sampling_params={"ignore_eos": True, "stop_token_ids": [stop_id]}
    )
    first = full["output_ids"].index(stop_id)
    assert out["output_ids"] == full["output_ids"][: first + 1]  # includes the stop token
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["text"] == tok.decode(full["output_ids"][:first])


def test_bad_requests_are_400_with_error_message(engine):
    r = engine.client.post("/generate", content=b"")
    assert r.status_code == 400 and "missing request body" in r.json()["error"]["message"]
    r = engine.client.post("/pause_generation", content=b"")
    assert r.status_code == 400
    r = engine.post(
        "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2, "bogus": 1}}
    )
    assert r.status_code == 400 and "bogus" in r.json()["error"]["message"]
    r = engine.post("/generate", {"text": "a", "input_ids": [1]})
    assert (
        r.status_code == 400 and "exactly one of text or input_ids" in r.json()["error"]["message"]
    )
    r = engine.post("/generate", {"text": "a", "sampling_params": {"top_p": 0}})
    assert r.status_code == 400 and "top_p" in r.json()["error"]["message"]


def test_info_and_health(engine, models):
    assert engine.client.get("/health").status_code == 200
    info = engine.client.get("/get_model_info").json()
    assert info["model_path"] == str(models["old"][0]) and info["is_generation"] is True
    server = engine.client.get("/get_server_info").json()
    assert server["tp_size"] == 1 and server["host"] == "127.0.0.1" and "version" in server
    r = engine.post("/update_weight_version", {"new_version": "v7"})
    assert r.status_code == 200
    assert engine.client.get("/model_info").json()["weight_version"] == "v7"
    assert generate(engine, "a", 2)["meta_info"]["weight_version"] == "v7"
    engine.post("/update_weight_version", {"new_version": "default"})


# ---- pause / continue / flush / abort -----------------------------------------------------
def _long_request(engine, n=150, rid=None):
    body = {
        "text": "hello",
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }
    if rid:
        body["rid"] = rid
    return engine.post("/generate", body).json()


def _wait_running(engine, count=1, timeout=30):
    deadline = time.monotonic() + timeout
    while engine.client.get("/get_server_info").json()["num_requests"] < count:
        assert time.monotonic() < deadline, "request never started"
        time.sleep(0.01)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_blocks_new_requests_and_continue_releases(engine, models, mode):
    want = reference(models, "old", ("hello",), 150)[0]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(_long_request, engine)
        _wait_running(engine)
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
        running = pool.submit(_long_request, engine, 400)
        _wait_running(engine)
        assert engine.post("/pause_generation", {"mode": "abort"}).status_code == 200
        out = running.result(timeout=60)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) < 400
    assert engine.post("/continue_generation").status_code == 200


def test_flush_refused_while_running_then_accepted(engine):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(_long_request, engine, 200)
        _wait_running(engine)
        r = engine.post("/flush_cache")
        assert r.status_code == 400 and "running" in r.json()["error"]["message"]
        running.result(timeout=60)
    assert engine.client.get("/flush_cache").status_code == 200


def test_abort_request_by_rid_prefix(engine):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        victim = pool.submit(_long_request, engine, 300, "victim-123")
        other = pool.submit(_long_request, engine, 40, "other-1")
        _wait_running(engine, 2)
        assert engine.post("/abort_request", {"rid": ""}).status_code == 200  # a no-op, as SGLang
        r = engine.post("/abort_request", {"rid": "victim"})
        assert r.status_code == 200
        assert victim.result(timeout=60)["meta_info"]["finish_reason"]["type"] == "abort"
        assert other.result(timeout=60)["meta_info"]["finish_reason"] == {
            "type": "length",
            "length": 40,
        }


# ---- weight updates -----------------------------------------------------------------------
def _assert_generates(engine, models, which):
    got = [o["output_ids"] for o in generate(engine, PROMPTS)]
    assert got == reference(models, which)


def test_update_from_tensor_direct_and_flattened_bucket(engine, models):
    new_state = list(models["new"][1].state_dict().items())
    r = engine.post(
        "/update_weights_from_tensor",
        {"serialized_named_tensors": [serialize(new_state)], "weight_version": "t1"},
    )
    assert r.status_code == 200 and r.json()["success"], r.text
    _assert_generates(engine, models, "new")
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
    _assert_generates(engine, models, "old")


def test_update_from_disk(engine, models):
    r = engine.post(
        "/update_weights_from_disk", {"model_path": str(models["new"][0]), "weight_version": "d1"}
    )
    assert r.status_code == 200 and r.json()["success"], r.text
    _assert_generates(engine, models, "new")
    assert (
        engine.post("/update_weights_from_disk", {"model_path": str(models["old"][0])}).status_code
        == 200
    )
    _assert_generates(engine, models, "old")
    r = engine.post("/update_weights_from_disk", {"model_path": "/nonexistent/dir"})
    assert (
        r.status_code == 400
        and r.json()["success"] is False
        and "/nonexistent/dir" in r.json()["message"]
    )


def test_update_from_distributed_gloo(engine, models):
    """The test process is rank 0 and hosts the TCPStore, as the trainer does."""
    import torch.distributed as dist
    from miles_launch.engine.weights import join_weight_update_group

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
            _assert_generates(engine, models, which)
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
    _assert_generates(engine, models, "old")


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
    _assert_generates(engine, models, "old")  # restored from the CPU backup
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
        running = pool.submit(_long_request, engine)
        _wait_running(engine)
        assert engine.post("/begin_weight_update").status_code == 200
        update = pool.submit(
            engine.post, "/update_weights_from_disk", {"model_path": str(models["new"][0])}
        )
        time.sleep(0.3)
        late = pool.submit(generate, engine, ("ab",), 4)
        assert update.result(timeout=60).status_code == 200
        assert (
            running.result(timeout=60)["output_ids"] == want
        )  # not one token from the new weights
        assert [o["output_ids"] for o in late.result(timeout=60)] == reference(
            models, "new", ("ab",), 4
        )
    _assert_generates(engine, models, "new")
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
        running = pool.submit(_long_request, engine)
        _wait_running(engine)
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
