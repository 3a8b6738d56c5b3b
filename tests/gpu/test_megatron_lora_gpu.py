"""Megatron LoRA on GPUs with NCCL (TP=2 on 2 devices, TP=1 on one): the CPU test's backend run
(tests/miles_megatron/test_megatron_lora.py) — lora_base KL, sleep/wake x2 equal to a never-slept run
with the frozen base copied to the host once, adapter-only checkpoint resumed at TP=1, PEFT
export loaded by PEFT and the FSDP backend, merged publish bit-exact.

    python -m pytest tests/gpu/test_megatron_lora_gpu.py -q
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# the CPU tests' support: the rank functions and the spawn harness (NCCL, one GPU per rank)
sys.path.insert(0, str(Path(__file__).parents[1] / "miles_megatron"))
from dist_ranks import spawn_ranks  # noqa: E402

nccl_ranks = functools.partial(spawn_ranks, timeout=600, shim=False, backend="nccl")
TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]


def test_lora_backend_flow_on_gpus(tmp_path):
    from lora_ranks import backend_lora_flow, check_lora_flow, peft_adapter
    from megatron_tiny_models import make_tiny_hf

    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    adapter = str(peft_adapter(hf_dir, tmp_path / "adapter", TARGETS))
    export = tmp_path / "export"
    paths = (hf_dir, adapter, str(tmp_path / "save"), str(export))
    world = min(2, torch.cuda.device_count())
    results = nccl_ranks(backend_lora_flow, world, *paths)
    check_lora_flow(results[0], hf_dir, export, TARGETS)
