"""Megatron LoRA on GPUs with NCCL (TP=2 on 2 devices, TP=1 on one): the CPU test's backend run
(tests/miles_megatron/test_megatron_lora.py) — lora_base KL, sleep/wake x2 equal to a never-slept run
with the frozen base copied to the host once, adapter-only checkpoint resumed at TP=1, PEFT
export loaded by PEFT and the FSDP backend, merged publish bit-exact.

    python -m pytest tests/gpu/test_megatron_lora_gpu.py -q
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import traceback
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SUPPORT = str(Path(__file__).parents[1] / "miles_megatron")
sys.path.insert(0, SUPPORT)
TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]


def _rank(rank: int, world: int, port: int, paths: tuple[str, ...], queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    try:
        sys.path.insert(0, SUPPORT)
        import torch.distributed as dist
        from lora_ranks import backend_lora_flow

        torch.cuda.set_device(rank)
        dist.init_process_group("nccl")
        result = backend_lora_flow(rank, world, *paths)
        dist.destroy_process_group()
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001  (reported to the parent)
        queue.put((rank, "error", traceback.format_exc()))


def test_lora_backend_flow_on_gpus(tmp_path):
    from lora_ranks import check_lora_flow, peft_adapter
    from megatron_tiny_models import make_tiny_hf

    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    adapter = str(peft_adapter(hf_dir, tmp_path / "adapter", TARGETS))
    export = tmp_path / "export"
    paths = (hf_dir, adapter, str(tmp_path / "save"), str(export))
    world = min(2, torch.cuda.device_count())
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, world, port, paths, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    for _ in range(world):
        rank, status, value = queue.get(timeout=600)
        assert status == "ok", value
        results[rank] = value
    for p in procs:
        p.join(timeout=30)
    check_lora_flow(results[0], hf_dir, export, TARGETS)
