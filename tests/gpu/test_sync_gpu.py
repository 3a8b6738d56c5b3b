"""Weight sync on GPUs with the built-in engine: CUDA IPC (colocated, one GPU) and NCCL broadcast
(two GPUs). The engine's weights must equal the trainer's bf16 tensors bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).parents[1] / "miles_sync"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from sync_testing import save_checkpoint, tiny_model

    return save_checkpoint(tiny_model(0), tmp_path_factory.mktemp("gpu-sync") / "ckpt")


def gpu_source(model):
    from sync_testing import source

    for name, tensor in source(model):
        yield name, tensor.to("cuda:0")


def check(engine, model):
    from sync_testing import expected_digests

    want = expected_digests(model)
    got = engine.digests()
    assert {name: got[name] for name in want} == want


@pytest.mark.parametrize("mode", ["ipc", "broadcast"])
def test_publish_on_gpu(mode, checkpoint):
    from miles_sync.weight_sync import SyncConfig, WeightPublisher
    from sync_testing import Engine, tiny_model, train_step

    if mode == "broadcast" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL broadcast needs a second GPU for the engine")
    device = "cuda:0" if mode == "ipc" else "cuda:1"
    engine = Engine(checkpoint, device=device)
    try:
        torch.cuda.set_device(0)
        config = SyncConfig(mode=mode, colocate=mode == "ipc", buffer_size=2048)
        publisher = WeightPublisher(config)
        model = tiny_model(0)
        for seed in (1, 2):
            train_step(model, seed)
            version = publisher.update_weights(gpu_source(model), [engine.url])
            assert engine.version() == str(version)
            check(engine, model)
        publisher.close()
    finally:
        engine.close()
