"""`miles train`'s trainer rank on a GPU (``TrainerRank.init``, the code each Ray actor runs):
with ``--fsdp-cpu-offload`` the default group it makes is ``cpu:gloo,cuda:nccl`` (read back from
torch), and the FSDP backend initialises on it and trains one rollout with its shards on the
host; without a CPU-offload flag the group is NCCL alone.

Run on a GPU node: ``uv run pytest tests/gpu/test_launcher_group_gpu.py`` (skipped without CUDA).
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "miles_fsdp"))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _rank(hf_dir: str, flags: list[str], queue) -> None:
    try:
        from miles_core.batch import RolloutBatch, Sample
        from miles_launch.trainer_group import TrainerRank
        from run_args import command_line, parse

        args = parse(*command_line(hf_checkpoint=hf_dir, advantage_estimator="grpo"), *flags)
        rank = TrainerRank(0, 1, "fsdp", use_gpu=True)
        from miles_core.ports import free_port

        rank.init(args, "127.0.0.1", free_port())
        group = rank.process_group()
        g = torch.Generator().manual_seed(0)
        samples = [
            Sample(
                tokens=torch.randint(1, 60, (9,), generator=g),
                response_length=5,
                reward=float(i % 2),
                group_index=i // 2,
            )
            for i in range(4)
        ]
        metrics = rank.train(0, RolloutBatch(samples))
        param = next(rank.backend.model.parameters())
        queue.put((group, str(param.to_local().device), metrics["pg_loss"]))
        rank.close()
    except BaseException as error:  # noqa: BLE001 (reported to the test)
        queue.put(repr(error))


def run(hf_dir: str, flags: list[str]):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_rank, args=(hf_dir, flags, queue))
    proc.start()
    result = queue.get(timeout=600)
    proc.join(60)
    assert not isinstance(result, str), result
    return result


def test_fsdp_cpu_offload_trains_on_the_launchers_group(tmp_path):
    from tiny_models import save_tiny_model

    hf_dir = str(save_tiny_model(tmp_path / "m"))
    group, device, loss = run(hf_dir, ["--fsdp-cpu-offload"])
    assert group == "cpu:gloo,cuda:nccl"
    assert device == "cpu"  # FSDP keeps the shards on the host
    assert loss == loss  # finite: it trained
    group, device, _ = run(hf_dir, [])
    assert group == "nccl" and device.startswith("cuda")
