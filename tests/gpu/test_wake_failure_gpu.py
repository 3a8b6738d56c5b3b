"""FSDP backend on 1 GPU: a wake the device cannot hold fails as one ``WakeFailed`` and leaves
the backend asleep with nothing of the failed wake on the device; once memory is free again a
wake restores the weights and the AdamW state bit for bit.

The failure is the driver's own: the rest of the device is taken by one allocation before the
wake (no fault hook), so what is tested is the real ``torch.OutOfMemoryError`` path of
``miles_offload.allocation`` on CUDA, with the free and held memory the message reports.

Run on a GPU node: ``pytest tests/gpu/test_wake_failure_gpu.py`` (skipped without CUDA).
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

#: what is left free beside the filler: far less than the ~1 GiB the wake moves back
LEFT_FREE = 64 * 2**20


def _state(backend) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()

    out = {f"param.{n}": full(p) for n, p in backend.model.named_parameters()}
    params = [p for g in backend.optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for k, v in backend.optimizer.state[p].items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out[f"optim.{i}.{k}"] = full(v)
    return out


def failed_wake_program(rank, world, hf_dir, out_file):
    from miles_core.batch import RolloutBatch
    from miles_fsdp.backend import FSDPBackend
    from miles_offload.allocation import WakeFailed
    from run_args import make_args
    from samples import make_samples

    backend = FSDPBackend()
    backend.init(make_args(hf_checkpoint=hf_dir, fsdp_compute_dtype="bf16", lr=1e-4))
    device = backend.device
    backend.train(0, RolloutBatch(make_samples(seed=0)))
    before = _state(backend)
    backend.sleep()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    asleep = torch.cuda.memory_allocated(device)
    free, _ = torch.cuda.mem_get_info(device)
    filler = torch.empty(free - LEFT_FREE, dtype=torch.uint8, device=device)
    row: dict = {"filler": filler.numel(), "asleep": asleep}
    try:
        backend.wake_up()
        row["error"] = None
    except WakeFailed as error:
        row |= {"error": str(error), "stage": error.stage, "nbytes": error.nbytes}
    except torch.OutOfMemoryError as error:  # not caught by the wake: the test fails on it
        row["error"] = f"raw: {error}"
    torch.cuda.synchronize(device)
    row["after_failure"] = torch.cuda.memory_allocated(device)
    row["still_asleep"] = backend.asleep
    del filler
    torch.cuda.empty_cache()
    backend.wake_up()
    after = _state(backend)
    row["keys"] = len(before)
    row["equal"] = sorted(before) == sorted(after) and all(
        torch.equal(before[k], after[k]) for k in before
    )
    backend.train(1, RolloutBatch(make_samples(seed=1)))  # and it trains on
    backend.close()
    torch.save(row, out_file)


def test_a_wake_the_device_cannot_hold_fails_cleanly_and_a_retry_restores(tmp_path):
    config = qwen3_config(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=128,
    )  # fmt: skip
    hf_dir = str(save_tiny_model(tmp_path / "m", config))
    out = tmp_path / "row.pt"
    run_ranks(1, failed_wake_program, hf_dir, str(out), backend="nccl", timeout=600)
    row = torch.load(out, weights_only=True)
    assert row["error"] and not row["error"].startswith("raw:"), row["error"]
    assert row["error"].startswith("wake of actor failed allocating"), row["error"]
    assert "free" in row["error"] and str(row["nbytes"]) in row["error"], row["error"]
    # nothing of the failed wake stays on the device: the filler and the sleeping state only
    assert row["after_failure"] == row["asleep"] + row["filler"], row
    assert row["still_asleep"]
    assert row["keys"] > 0 and row["equal"]
