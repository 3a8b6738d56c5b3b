"""The built-in engine on a GPU: greedy equals transformers, CUDA-IPC tensor updates (both
formats), NCCL broadcast updates (needs 2 GPUs), and release/resume freeing device memory."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import sys
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "miles_launch"))
from engine_testing import EngineProcess, free_port, save_tokenizer, tiny_qwen3  # noqa: E402
from miles_sync.buckets import (  # noqa: E402
    aligned_order,
    dumps_sglang_wire,
    pack_bucket,
    to_sglang_metadata,
)

pytestmark = pytest.mark.gpu
PROMPTS = ["hello world", "ab", "the quick brown fox jumps"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_engine")
    models = {}
    for name, seed in (("old", 0), ("new", 1)):
        model = tiny_qwen3(seed)
        model.save_pretrained(root / name)
        tok = save_tokenizer(root / name)
        models[name] = model.cuda()
    device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    server = EngineProcess(root / "old", "--device", device, "--enable-weights-cpu-backup")
    refs = {k: [hf_greedy_cuda(m, tok.encode(p)) for p in PROMPTS] for k, m in models.items()}
    yield server, models, tok, refs, device
    server.close()


def hf_greedy_cuda(model, ids):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids], device="cuda"),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=0,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def _generate(server):
    body = {"text": PROMPTS, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
    return [o["output_ids"] for o in server.post("/generate", body).json()]


def test_greedy_equals_transformers_on_gpu(setup):
    server, _, _, refs, _ = setup
    assert _generate(server) == refs["old"]


def test_cuda_ipc_tensor_updates(setup):
    server, models, _, refs, _ = setup
    named = [(n, t.detach().contiguous()) for n, t in models["new"].state_dict().items()]
    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    r = server.post(
        "/update_weights_from_tensor",
        {"serialized_named_tensors": [base64.b64encode(buf.getvalue()).decode()]},
    )
    assert r.status_code == 200, r.text
    assert _generate(server) == refs["new"]
    flat, meta = pack_bucket(
        [(n, t.detach().contiguous()) for n, t in models["old"].state_dict().items()]
    )
    payload = base64.b64encode(
        dumps_sglang_wire({"flattened_tensor": flat, "metadata": to_sglang_metadata(meta)})
    )
    r = server.post(
        "/update_weights_from_tensor",
        {"serialized_named_tensors": [payload.decode()], "load_format": "flattened_bucket"},
    )
    assert r.status_code == 200, r.text
    assert _generate(server) == refs["old"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs the engine on another GPU")
def test_nccl_broadcast_update(setup):
    import torch.distributed as dist
    from miles_launch.builtin_engine.weights import join_weight_update_group

    server, models, _, refs, _ = setup
    port = free_port()
    torch.cuda.set_device(0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        body = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "backend": "nccl",
        }
        joined = pool.submit(server.post, "/init_weights_update_group", body)
        pg = join_weight_update_group(
            "127.0.0.1", port, 0, 2, "weight_update_group", "nccl", is_master=True
        )
        assert joined.result(timeout=120).status_code == 200
        for which, fmt in (("new", None), ("old", "flattened_bucket")):
            named = [(n, t.detach().contiguous()) for n, t in models[which].state_dict().items()]
            if fmt == "flattened_bucket":  # names in the bucket's order (aligned_order)
                named = aligned_order(named)
            req = {
                "names": [n for n, _ in named],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
                "shapes": [list(t.shape) for _, t in named],
                "load_format": fmt,
            }
            reply = pool.submit(server.post, "/update_weights_from_distributed", req)
            if fmt is None:
                for _, t in named:
                    dist.broadcast(t, src=0, group=pg)
            else:
                dist.broadcast(pack_bucket(named)[0], src=0, group=pg)
            assert reply.result(timeout=120).status_code == 200
            assert _generate(server) == refs[which]
        # NCCL teardown waits for the peer: both sides destroy at once.
        destroyed = pool.submit(server.post, "/destroy_weights_update_group", {})
        dist.destroy_process_group(pg)
        assert destroyed.result(timeout=120).status_code == 200


def test_release_frees_device_memory(setup):
    server, _, _, refs, _ = setup
    before = server.client.get("/get_server_info").json()["memory"]
    assert server.post("/release_memory_occupation", {}).status_code == 200
    after = server.client.get("/get_server_info").json()["memory"]
    assert after["weights_bytes"] == 0
    assert (
        after["device_allocated_bytes"]
        <= before["device_allocated_bytes"] - before["weights_bytes"]
    )
    assert server.post("/resume_memory_occupation", {}).status_code == 200
    assert _generate(server) == refs["old"]
