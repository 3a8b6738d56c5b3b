"""Built-in engine: routed experts of a tiny qwen3_moe, the API key, CLI errors, and the
weight store's release/resume without a CPU backup."""

from __future__ import annotations

import base64
import subprocess
import sys

import numpy as np
import pytest
import torch
from engine_testing import EngineProcess, save_tokenizer, tiny_qwen3, tiny_qwen3_moe
from miles_launch.builtin_engine.weights import WeightStore

API_KEY = "sekrit"


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    model = tiny_qwen3_moe(3)
    model.save_pretrained(root / "m")
    tok = save_tokenizer(root / "m")
    server = EngineProcess(root / "m", "--enable-return-routed-experts", api_key=API_KEY)
    yield server, model, tok
    server.close()


def _router_topk(model, ids: list[int]) -> np.ndarray:
    """Reference: the router logits of a plain forward, top-k by probability, per layer."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    per_layer = [
        torch.topk(torch.softmax(lg.float(), -1), k, dim=-1).indices for lg in out.router_logits
    ]
    return torch.stack(per_layer, dim=1).numpy()  # [tokens, layers, k]


@pytest.mark.slow
def test_routed_experts_shape_and_values(moe):
    """A batch of prompts of different lengths (prefilled together, left-padded): each
    request's experts equal the router top-k of a plain forward over its own sequence."""
    server, model, tok = moe
    prompts = [tok.encode("hello world"), tok.encode("ab"), tok.encode("the quick brown fox")]
    body = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        "return_routed_experts": True,
    }
    outs = server.post("/generate", body).json()
    cfg = model.config
    shape = (cfg.num_hidden_layers, cfg.num_experts_per_tok)
    for prompt, out in zip(prompts, outs):
        raw = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
        tokens = (
            len(prompt) + len(out["output_ids"]) - 1
        )  # every fed position; the last token is never fed
        routed = raw.reshape(tokens, *shape)
        want = _router_topk(model, prompt + out["output_ids"][:-1])
        np.testing.assert_array_equal(np.sort(routed, -1), np.sort(want, -1))
    body.update(input_ids=prompts[0], routed_experts_start_len=4)
    tail = server.post("/generate", body).json()["meta_info"]["routed_experts"]
    tail = np.frombuffer(base64.b64decode(tail), dtype=np.int32).reshape(-1, *shape)
    first = np.frombuffer(base64.b64decode(outs[0]["meta_info"]["routed_experts"]), dtype=np.int32)
    np.testing.assert_array_equal(tail, first.reshape(-1, *shape)[4:])


@pytest.mark.slow
def test_api_key_required(moe):
    server, _, _ = moe
    import httpx

    r = httpx.post(f"{server.url}/generate", json={"text": "a"})
    assert r.status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert server.client.get("/get_model_info").status_code == 200


def test_tp_size_above_one_is_an_error_naming_the_flag(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "miles_launch.builtin_engine",
            "--model-path",
            str(tmp_path),
            "--tp-size",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "--tp-size" in r.stderr


def test_weight_store_release_frees_and_resume_without_backup_needs_resync():
    model = tiny_qwen3(0)
    reference = {n: t.clone() for n, t in model.state_dict().items()}
    store = WeightStore(model, torch.device("cpu"), cpu_backup=False)
    total = store.weights_bytes()
    assert total == sum(t.numel() * t.element_size() for t in reference.values())
    store.release()
    assert store.weights_bytes() == 0
    assert all(p.numel() == 0 for p in model.parameters())
    rotary = {n: b.clone() for n, b in model.named_buffers() if n not in reference}
    assert rotary  # non-persistent buffers (rotary inv_freq) are not released
    assert all(torch.equal(dict(model.named_buffers())[n], b) for n, b in rotary.items())
    with pytest.raises(RuntimeError, match="released"):
        store.load_named(reference.items())
    store.resume()  # shapes come back, contents are whatever the allocator gave: re-sync
    assert store.weights_bytes() == total
    store.load_named(reference.items())
    assert all(torch.equal(model.state_dict()[n], t) for n, t in reference.items())
    with pytest.raises(ValueError, match="no.such"):  # WeightUpdateError, answered with 400
        store.load_named([("no.such", torch.ones(1))])
    name = next(iter(reference))
    with pytest.raises(ValueError, match=name):
        store.load_named([(name, torch.ones(3, 3, 3))])
