"""``miles_core.engine`` clients against the real built-in engine, endpoint by endpoint.

One server (module scope) serves a tiny Qwen3 saved to disk (conftest.py's ``models``); a
second set of weights (another seed) is the "new" model of the weight-update tests, which
restore the old one afterwards. References are transformers' own ``generate`` and a float64
forward pass of the same HF model. A second server, started with ``--api-key``, checks
authentication.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing
from engine_testing import EngineProcess, free_port, greedy_recompute, reference
from miles_core.engine import AsyncEngineClient, EngineClient, EngineError, SamplingParams
from miles_launch.builtin_engine.weights import join_weight_update_group
from miles_sync.buckets import aligned_order, dumps_sglang_wire, pack_bucket, to_sglang_metadata

# Starts an engine subprocess (torch + transformers import, model load).
pytestmark = pytest.mark.slow

PROMPTS = ["hello world", "ab", "the quick brown fox"]
NEW_TOKENS = 8
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
LONG = 400  # tokens of a request that must still be running when the test acts on it
API_KEY = "s3cret"


@pytest.fixture(scope="module")
def models(models):
    """The tiny models of conftest.py (their files; this module starts its own servers) plus
    transformers' greedy generations of PROMPTS, the reference."""
    out = dict(models)
    for name in ("old", "new"):
        out[f"{name}_ref"] = reference(models, name, tuple(PROMPTS), NEW_TOKENS)
    assert all(a != b for a, b in zip(out["old_ref"], out["new_ref"]))  # updates are visible
    return out


@pytest.fixture(scope="module")
def server(models):
    engine = EngineProcess(
        models["old"][0], "--enable-weights-cpu-backup", "--max-running-requests", "4"
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def keyed_server(models):
    """The second server: started with ``--api-key``."""
    engine = EngineProcess(models["old"][0], api_key=API_KEY)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def client(server):
    with EngineClient(server.url, timeout=60.0, retries=1) as engine:
        yield engine


@pytest.fixture(autouse=True)
def _unpaused(client):
    """A failed pause test must not leave the shared server paused for the next ones."""
    yield
    client.continue_generation()


def greedy_ids(client, prompts=PROMPTS) -> list[list[int]]:
    return [out["output_ids"] for out in client.generate(list(prompts), sampling_params=GREEDY)]


def long_request(client, rid: str) -> dict:
    params = SamplingParams(max_new_tokens=LONG, temperature=0.0, ignore_eos=True)
    return client.generate("hello", sampling_params=params, rid=rid)


def wait_running(client, count: int = 1, timeout: float = 30.0) -> None:
    """Poll the server until ``count`` requests are in its scheduler."""
    deadline = time.monotonic() + timeout
    while client.get_server_info()["num_requests"] < count:
        assert time.monotonic() < deadline, "request never started"
        time.sleep(0.01)


def flattened_payload(state_dict) -> tuple[str, torch.Tensor]:
    """One ``serialized_named_tensors`` entry for ``load_format="flattened_bucket"``: a
    ForkingPickler dump (SGLang's metadata class path) of the packed bucket, base64.
    Returns the bucket too: it must stay alive until the update call returns."""
    torch.multiprocessing.set_sharing_strategy("file_system")  # the engine is not our child
    flat, meta = pack_bucket([(n, t.clone()) for n, t in state_dict.items()])
    wire = dumps_sglang_wire({"flattened_tensor": flat, "metadata": to_sglang_metadata(meta)})
    return base64.b64encode(wire).decode(), flat


# ---- generate ----------------------------------------------------------------------------
def test_generate_text_and_input_ids_equal_model_generate(client, models):
    tok = models["tokenizer"]
    want = models["old_ref"][0]
    by_text = client.generate(PROMPTS[0], sampling_params=GREEDY)
    assert by_text["output_ids"] == want
    assert by_text["meta_info"]["prompt_tokens"] == len(tok.encode(PROMPTS[0]))
    assert by_text["meta_info"]["completion_tokens"] == len(want)
    if want[-1] != 0:  # no EOS: the text is the decoded output
        assert by_text["text"] == tok.decode(want)
    by_ids = client.generate(input_ids=tok.encode(PROMPTS[0]), sampling_params=GREEDY)
    assert by_ids["output_ids"] == want
    assert client.generate(PROMPTS[0], sampling_params=GREEDY)["output_ids"] == want
    with pytest.raises(ValueError, match="exactly one of text or input_ids"):
        client.generate(PROMPTS[0], input_ids=[1, 2])


def test_generate_batches(client, models):
    tok = models["tokenizer"]
    assert greedy_ids(client) == models["old_ref"]
    by_ids = client.generate(input_ids=[tok.encode(p) for p in PROMPTS], sampling_params=GREEDY)
    assert [o["output_ids"] for o in by_ids] == models["old_ref"]
    # per-prompt sampling params (SamplingParams and plain dicts mixed)
    lengths = [3, 5, 2]
    params = [
        SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True),
        {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True},
        SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True),
    ]
    outs = client.generate(PROMPTS, sampling_params=params)
    model = models["old"][1]
    for out, prompt, n in zip(outs, PROMPTS, lengths):
        assert len(out["output_ids"]) == n
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": n}
        assert out["output_ids"] == greedy_recompute(model, tok.encode(prompt), n)


def test_generate_logprobs_equal_a_forward_pass(client, models):
    tok, model = models["tokenizer"], models["old"][1]
    prompt_ids = tok.encode(PROMPTS[2])
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    out = client.generate(input_ids=prompt_ids, sampling_params=params, return_logprob=True)
    lps = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + out["output_ids"]])).logits[0]
    logp = torch.log_softmax(logits.double(), dim=-1)
    n = len(prompt_ids)
    want = [logp[n - 1 + i, t].item() for i, t in enumerate(out["output_ids"])]
    assert max(abs(lp - w) for (lp, _, _), w in zip(lps, want)) < 1e-5


def test_generate_bad_sampling_key_raises_with_server_message(client, server):
    bad = {"max_new_tokens": 2, "bogus_key": 1}
    with pytest.raises(EngineError) as caught:
        client.generate("ab", sampling_params=bad)
    raw = server.post("/generate", {"text": "ab", "sampling_params": bad})
    err = caught.value
    assert err.status_code == 400 and err.endpoint == "POST /generate"
    assert err.message == raw.json()["error"]["message"] and "bogus_key" in err.message
    assert err.message in str(err) and "HTTP 400" in str(err)


# ---- health and info ---------------------------------------------------------------------
def test_health_and_info(client, server, models):
    assert client.health() is True
    assert client.health_generate() is True
    client.wait_until_healthy(10)
    info = client.get_model_info()
    assert info["model_path"] == str(models["old"][0])
    assert info["tokenizer_path"] == str(models["old"][0])
    assert info["is_generation"] is True and info["weight_version"] == "default"
    server_info = client.get_server_info()
    assert server_info["port"] == server.port and server_info["host"] == "127.0.0.1"
    assert server_info["tp_size"] == 1 and server_info["version"]
    assert server_info["enable_weights_cpu_backup"] is True and "api_key" not in server_info


def test_update_weight_version(client):
    assert client.update_weight_version("v7")["success"] is True
    assert client.get_model_info()["weight_version"] == "v7"
    out = client.generate("ab", sampling_params=SamplingParams(max_new_tokens=2))
    assert out["meta_info"]["weight_version"] == "v7"
    # abort_all_requests (the default) aborts what is running
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(long_request, client, "version-1")
        wait_running(client)
        client.update_weight_version("default")
        out = running.result(timeout=60)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert client.get_model_info()["weight_version"] == "default"


# ---- pause / continue / flush / abort ----------------------------------------------------
@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_blocks_generate_until_continue(client, models, mode):
    continued = threading.Event()

    def blocked_generate():
        out = client.generate(PROMPTS[1], sampling_params=GREEDY)
        return out, continued.is_set()  # was continue sent before the reply came?

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(long_request, client, f"pause-{mode}")
        wait_running(client)
        client.pause_generation(mode)
        if mode == "abort":  # running requests come back aborted
            aborted = running.result(timeout=60)
            assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
            assert len(aborted["output_ids"]) < LONG
        blocked = pool.submit(blocked_generate)
        # The reply can only come after continue; the wait is a chance for a bug to show.
        with pytest.raises(concurrent.futures.TimeoutError):
            blocked.result(timeout=0.5)
        if mode != "abort":
            assert not running.done()  # held by the pause, not finished
        continued.set()
        client.continue_generation()
        out, after_continue = blocked.result(timeout=60)
        assert after_continue and out["output_ids"] == models["old_ref"][1]
        if mode != "abort":  # the paused request was kept; end it now
            client.abort_request(f"pause-{mode}")
            assert running.result(timeout=60)["meta_info"]["finish_reason"]["type"] == "abort"


def test_async_client_pause_continue_and_errors(server, models):
    async def scenario():
        async with AsyncEngineClient(server.url, timeout=60.0) as engine:
            assert await engine.health() is True
            assert (await engine.get_model_info())["weight_version"] == "default"
            await engine.pause_generation("in_place")
            task = asyncio.create_task(engine.generate(PROMPTS[1], sampling_params=GREEDY))
            done, _ = await asyncio.wait({task}, timeout=0.5)  # a chance for a bug to show
            assert not done
            await engine.continue_generation()
            out = await asyncio.wait_for(task, 60)
            assert (await engine.flush_cache())["success"] is True
            with pytest.raises(EngineError) as caught:
                await engine.generate("ab", sampling_params={"max_new_tokens": 2, "nope": 0})
            return out, caught.value

    out, err = asyncio.run(scenario())
    assert out["output_ids"] == models["old_ref"][1]
    assert err.status_code == 400 and "nope" in err.message


def test_flush_cache_idle_and_refused_while_running(client):
    assert client.flush_cache()["success"] is True
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(long_request, client, "flush-1")
        wait_running(client)
        with pytest.raises(EngineError) as caught:
            client.flush_cache()
        client.abort_request("flush-1")
        assert running.result(timeout=60)["meta_info"]["finish_reason"]["type"] == "abort"
    err = caught.value
    assert err.status_code == 400 and err.endpoint == "POST /flush_cache"
    assert err.message == "flush_cache refused: requests are running or waiting"
    assert client.flush_cache()["success"] is True


def test_abort_request_by_rid_prefix_and_all(client, models):
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        victim = pool.submit(long_request, client, "victim-123")
        others = [pool.submit(long_request, client, rid) for rid in ("other-1", "other-2")]
        wait_running(client, 3)
        reply = client.abort_request("victim")  # matched as a prefix
        assert reply == {"success": True, "message": "aborted 1 request(s)"}
        assert victim.result(timeout=60)["meta_info"]["finish_reason"]["type"] == "abort"
        assert not any(fut.done() for fut in others)
        client.abort_request(abort_all=True)
        for fut in others:
            out = fut.result(timeout=60)
            assert out["meta_info"]["finish_reason"]["type"] == "abort"
            assert len(out["output_ids"]) < LONG
    assert greedy_ids(client) == models["old_ref"]  # the server serves on


# ---- weight updates ----------------------------------------------------------------------
def test_update_weights_from_tensor_flattened_bucket(client, server, models):
    payload, flat = flattened_payload(models["new"][1].state_dict())
    with client.weight_update() as engine:
        assert engine is client
        reply = client.update_weights_from_tensor(
            [payload], load_format="flattened_bucket", weight_version="tensor-new"
        )
    assert reply["success"] is True and client.supports_weight_update_session
    assert greedy_ids(client) == models["new_ref"]
    assert client.get_model_info()["weight_version"] == "tensor-new"
    out = client.generate("ab", sampling_params=SamplingParams(max_new_tokens=2))
    assert out["meta_info"]["weight_version"] == "tensor-new"

    # Outside begin/end (now that the server has seen them) the update is refused ...
    payload, flat = flattened_payload(models["old"][1].state_dict())
    with pytest.raises(EngineError) as caught:
        client.update_weights_from_tensor([payload], load_format="flattened_bucket")
    assert caught.value.status_code == 400 and "begin_weight_update" in caught.value.message
    # ... and end is sent even when the block raises: the window is closed again after it.
    with pytest.raises(RuntimeError, match="trainer failed"), client.weight_update():
        raise RuntimeError("trainer failed")
    with pytest.raises(EngineError, match="begin_weight_update"):
        client.update_weights_from_tensor([payload], load_format="flattened_bucket")

    async def restore():  # the async client's weight_update and update_weights_from_tensor
        async with AsyncEngineClient(server.url, timeout=60.0) as engine:
            async with engine.weight_update():
                reply = await engine.update_weights_from_tensor(
                    [payload], load_format="flattened_bucket", weight_version="default"
                )
            return reply, await engine.generate(PROMPTS, sampling_params=GREEDY)

    reply, outs = asyncio.run(restore())
    assert reply["success"] is True
    assert [o["output_ids"] for o in outs] == models["old_ref"]
    del flat


def test_update_weights_from_disk(client, models):
    reply = client.update_weights_from_disk(str(models["new"][0]), weight_version="disk-new")
    assert reply["success"] is True
    assert greedy_ids(client) == models["new_ref"]
    assert client.get_model_info()["weight_version"] == "disk-new"
    client.update_weights_from_disk(str(models["old"][0]), weight_version="default")
    assert greedy_ids(client) == models["old_ref"]
    with pytest.raises(EngineError) as caught:
        client.update_weights_from_disk("/nonexistent/checkpoint")
    assert caught.value.status_code == 400
    assert "/nonexistent/checkpoint" in caught.value.message
    assert greedy_ids(client) == models["old_ref"]


def test_update_weights_from_distributed_gloo(client, models):
    """The test process is rank 0 of the group and hosts its TCPStore, as the trainer does."""
    port = free_port()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        joined = pool.submit(
            client.init_weights_update_group,
            "127.0.0.1",
            port,
            1,
            2,
            group_name="client-wu",
            backend="gloo",
        )
        group = join_weight_update_group("127.0.0.1", port, 0, 2, "client-wu", "gloo", True)
        assert joined.result(timeout=60)["success"] is True
        try:
            for which, load_format in (("new", "flattened_bucket"), ("old", None)):
                named = list(models[which][1].state_dict().items())
                if load_format == "flattened_bucket":  # names in the bucket's order
                    named = aligned_order(named)
                with client.weight_update():
                    reply = pool.submit(
                        client.update_weights_from_distributed,
                        [n for n, _ in named],
                        [t.dtype for _, t in named],  # torch dtypes, sent as names
                        [t.shape for _, t in named],
                        group_name="client-wu",
                        load_format=load_format,
                        weight_version=f"dist-{which}",
                    )
                    if load_format == "flattened_bucket":
                        dist.broadcast(pack_bucket(named)[0], src=0, group=group)
                    else:
                        for _, tensor in named:
                            dist.broadcast(tensor.contiguous(), src=0, group=group)
                    assert reply.result(timeout=60)["success"] is True
                assert greedy_ids(client) == models[f"{which}_ref"]
                assert client.get_model_info()["weight_version"] == f"dist-{which}"
            assert client.destroy_weights_update_group("client-wu")["success"] is True
        finally:
            dist.destroy_process_group(group)
    with pytest.raises(EngineError) as caught:
        client.destroy_weights_update_group("client-wu")
    assert caught.value.status_code == 400 and "client-wu" in caught.value.message
    client.update_weight_version("default")


# ---- memory ------------------------------------------------------------------------------
def test_release_and_resume_memory(client, models):
    weights_bytes = client.get_server_info()["memory"]["weights_bytes"]
    assert weights_bytes > 0
    client.release_memory_occupation()  # all tags
    assert client.get_server_info()["memory"] == {"weights_bytes": 0, "kv_cache_bytes": 0}
    released = client.generate("ab", sampling_params=SamplingParams(max_new_tokens=2))
    assert released["meta_info"]["finish_reason"]["type"] == "abort"
    client.resume_memory_occupation(["weights", "kv_cache"])
    assert client.get_server_info()["memory"]["weights_bytes"] == weights_bytes
    assert greedy_ids(client) == models["old_ref"]  # restored from the CPU backup
    with pytest.raises(ValueError, match="memory tags"):
        client.release_memory_occupation(["bogus"])


# ---- API key (the second server) ---------------------------------------------------------
def test_api_key(keyed_server, models):
    server = keyed_server
    with EngineClient(server.url, timeout=60.0) as anonymous:
        assert anonymous.health() is True  # /health is public, as in SGLang
        with pytest.raises(EngineError) as caught:
            anonymous.get_model_info()
        assert caught.value.status_code in (401, 403)
        assert "api key" in caught.value.message
        with pytest.raises(EngineError) as caught:
            anonymous.generate("ab", sampling_params=GREEDY)
        assert caught.value.status_code in (401, 403)
    with EngineClient(server.url, api_key="wrong", timeout=60.0) as wrong:
        with pytest.raises(EngineError) as caught:
            wrong.flush_cache()
        assert caught.value.status_code in (401, 403)
    with EngineClient(server.url, api_key=API_KEY, timeout=60.0) as keyed:
        assert keyed.get_model_info()["model_path"] == str(models["old"][0])
        assert greedy_ids(keyed) == models["old_ref"]

    async def keyed_async():
        async with AsyncEngineClient(server.url, api_key=API_KEY, timeout=60.0) as engine:
            await engine.wait_until_healthy(10)
            return await asyncio.gather(
                *(engine.generate(p, sampling_params=GREEDY) for p in PROMPTS)
            )

    outs = asyncio.run(keyed_async())
    assert [o["output_ids"] for o in outs] == models["old_ref"]
