"""Engine client requests: auth header, JSON bodies, argument checks, per-call timeouts."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from miles_core.engine import SamplingParams
from scripted_engine import Server


def test_bearer_header_only_with_api_key():
    server = Server()
    server.client(api_key="sekrit").get_model_info()
    server.client().get_model_info()
    assert server.requests[0].headers["authorization"] == "Bearer sekrit"
    assert "authorization" not in server.requests[1].headers


def test_posts_without_arguments_send_an_empty_json_object():
    server = Server()
    client = server.client()
    client.continue_generation()
    client.flush_cache()
    client.end_weight_update()
    client.release_memory_occupation()
    client.resume_memory_occupation()
    for request in server.requests:
        assert request.method == "POST"
        assert request.headers["content-type"] == "application/json"
        assert json.loads(request.content) == {}


def test_generate_body_and_argument_checks():
    server = Server({("POST", "/generate"): [httpx.Response(200, json=[{"text": "a"}] * 2)]})
    client = server.client()
    out = client.generate(
        input_ids=[[1, 2], [3]], sampling_params=SamplingParams(max_new_tokens=4, temperature=0.0)
    )
    assert out == [{"text": "a"}] * 2
    body = json.loads(server.requests[0].content)
    assert body == {
        "input_ids": [[1, 2], [3]],
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
    }
    with pytest.raises(ValueError, match="exactly one of text or input_ids"):
        client.generate("a", input_ids=[1])
    with pytest.raises(ValueError, match="exactly one of text or input_ids"):
        client.generate()
    with pytest.raises(ValueError, match="pause mode"):
        client.pause_generation("later")
    with pytest.raises(ValueError, match="memory tags"):
        client.release_memory_occupation(["weights", "optimizer"])
    with pytest.raises(ValueError, match="differ in length"):
        client.update_weights_from_distributed(["a"], ["float32", "float32"], [[1]])
    assert len(server.requests) == 1  # refused before sending


def test_weight_update_bodies_send_only_what_is_set():
    server = Server()
    client = server.client()
    client.init_weights_update_group("10.0.0.1", 29500, 1, 3)
    client.update_weights_from_distributed(["w", "b"], [torch.bfloat16, "float32"], [(2, 3), [4]])
    client.update_weights_from_tensor(["AAAA"], load_format="flattened_bucket", weight_version="v2")
    client.update_weights_from_disk("/ckpt")
    client.update_weight_version(12)
    client.abort_request()
    bodies = [json.loads(r.content) for r in server.requests]
    assert bodies == [
        {
            "master_address": "10.0.0.1",
            "master_port": 29500,
            "rank_offset": 1,
            "world_size": 3,
            "group_name": "weight_update_group",
            "backend": "nccl",
        },
        {
            "names": ["w", "b"],
            "dtypes": ["bfloat16", "float32"],
            "shapes": [[2, 3], [4]],
            "group_name": "weight_update_group",
        },
        {
            "serialized_named_tensors": ["AAAA"],
            "load_format": "flattened_bucket",
            "weight_version": "v2",
        },
        {"model_path": "/ckpt"},
        {"new_version": "12", "abort_all_requests": True},
        {"rid": "", "abort_all": False},
    ]
    with pytest.raises(TypeError, match="base64 strings"):
        client.update_weights_from_tensor([b"raw bytes"])


def test_per_call_timeout_overrides_the_client_default():
    server = Server()
    client = server.client(timeout=42.0, connect_timeout=3.0)
    client.get_model_info()
    client.generate("x", timeout=7.5)
    default, override = (r.extensions["timeout"] for r in server.requests)
    assert default == {"connect": 3.0, "read": 42.0, "write": 42.0, "pool": 42.0}
    assert override["read"] == 7.5 and override["connect"] == 3.0
