"""MegatronBackend on 2 GPUs with NCCL, the checks of the CPU (gloo) tests:

* TP=2: each of two rollouts' steps through DDP and the distributed optimizer matches the
  float64 HF + torch AdamW step from the same weights (backend_reference.check, the code the
  CPU test runs), and the checkpoint resumes at TP=1 bit-exact
  (tests/miles_megatron/test_backend.py).
* PP=2: megatron's 1F1B schedule trains like PP=1 (TP=2) within 1e-5 in fp32 over 2 rollouts,
  and the PP=2 checkpoint loads at PP=1 bit-exact (tests/miles_megatron/test_pipeline.py).

Run: ``python -m pytest tests/gpu/test_megatron_gpu.py -v`` (2 GPUs; each test spawns its ranks).
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


def test_tp2_train_matches_hf_adamw_and_resumes_at_tp1(tmp_path):
    from backend_reference import check
    from megatron_ranks import backend_run
    from megatron_tiny_models import make_tiny_hf

    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    world = min(2, torch.cuda.device_count())
    results = nccl_ranks(backend_run, world, hf_dir, str(tmp_path / "ckpt"), world)
    check(results, hf_dir, device="cuda")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_pp2_trains_like_pp1_and_its_save_loads_at_pp1(tmp_path):
    from megatron_ranks import check_pipeline, pipeline_run
    from megatron_tiny_models import make_tiny_hf

    hf_dir = str(make_tiny_hf("qwen3", tmp_path / "hf"))
    r0, r1 = nccl_ranks(pipeline_run, 2, hf_dir, str(tmp_path / "ckpt"))
    check_pipeline(r0, r1)
