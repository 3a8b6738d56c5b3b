"""FSDP backend on 1 GPU: 20 sleep/wake cycles leave the device where the first sleep left it.

A colocated job sleeps and wakes the trainer once per rollout for thousands of rollouts; a leak of
a few MiB per cycle (a cached block never returned, a pinned staging buffer kept on the device, a
tensor that survives the sleep) would eventually take the engine's KV cache. After each sleep this
checks both the allocator's count (``memory_allocated``) and what the driver reports as used on
the device (``mem_get_info``: cached blocks and other libraries' memory included), against the
values after the first sleep. Training between the cycles also checks the weights came back.

Run on a GPU node: ``pytest tests/gpu/test_sleep_wake_cycles_gpu.py`` (skipped without CUDA).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "miles_fsdp"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spawn import run_ranks  # noqa: E402
from tiny_models import qwen3_config, save_tiny_model  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CYCLES = 20
#: Slack on the driver's used-memory reading: cuBLAS/NCCL work areas may be created lazily by
#: the first cycles' kernels. A leak of the model's size (several hundred MiB here) is far above.
DRIVER_SLACK = 64 * 2**20


def cycles_program(rank, world, hf_dir, out_file):
    from miles_core.batch import RolloutBatch
    from miles_fsdp.backend import FSDPBackend
    from run_args import make_args
    from samples import make_samples

    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=hf_dir, fsdp_compute_dtype="bf16", lr=1e-4))
    device = backend.device
    rows = []
    for cycle in range(CYCLES):
        backend.train(cycle, RolloutBatch(make_samples(seed=cycle)))  # wakes the backend if asleep
        torch.cuda.synchronize(device)
        awake = torch.cuda.memory_allocated(device)
        backend.sleep()
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        rows.append(
            {"awake": awake, "asleep": torch.cuda.memory_allocated(device), "used": total - free}
        )
    backend.close()
    torch.save(rows, out_file)


def test_twenty_sleep_wake_cycles_return_to_the_first_sleeps_memory(tmp_path):
    # big enough that one leaked copy of the weights or of AdamW's state stands out: ~90M params
    config = qwen3_config(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=128,
    )  # fmt: skip
    hf_dir = str(save_tiny_model(tmp_path / "m", config))
    out = tmp_path / "rows.pt"
    run_ranks(1, cycles_program, hf_dir, str(out), backend="nccl", timeout=600)
    rows = torch.load(out, weights_only=True)
    first = rows[0]
    awake_state = first["awake"] - first["asleep"]
    assert awake_state > 500 * 2**20, f"the sleep released only {awake_state / 2**20:.0f} MiB"
    for i, row in enumerate(rows):
        assert row["asleep"] == first["asleep"], f"cycle {i}: allocator {row} vs {first}"
        assert row["used"] <= first["used"] + DRIVER_SLACK, f"cycle {i}: driver {row} vs {first}"
