"""The colocated rollout cycle's residency with the Megatron backend
(``miles_launch.loop.ColocatedCycle``, the steps the synchronous loop takes): 2 gloo ranks at
TP=2 and a real built-in engine, ``--offload-train`` and ``--offload-rollout``, two rollouts
after the first publish. At every step the test records where the parameter buffers, the
optimizer state and the engine's weights and KV cache are, and asserts the order generate ->
engines release everything -> trainer wakes -> train -> trainer sleeps -> engines resume weights
only -> publish (trainer asleep, its model and optimizer state on the host, never woken) ->
engines resume KV cache and graphs; one wake and one sleep of the trainer per rollout
(:func:`colocated_testing.check_cycle`, shared with the FSDP test). The ``cpu`` target, under
``extended``; the default suite has the FSDP cycle (tests/miles_fsdp/test_colocated_cycle.py,
``disk``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "miles_sync"))

from colocated_testing import check_cycle, engine_checkpoint, with_engine  # noqa: E402
from dist_ranks import spawn_ranks  # noqa: E402
from megatron_tiny_models import make_tiny_hf  # noqa: E402

pytestmark = pytest.mark.slow


def on_device(tensors) -> int:
    """Bytes of the distinct storages of ``tensors`` that still hold memory on the device (the
    host on a CPU test machine: what did not move to the arena or the file)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() and storage._cdata not in seen:
            seen.add(storage._cdata)
            total += storage.nbytes()
    return total


def residency(backend):
    from colocated_testing import Residency
    from miles_megatron.sleep_wake import _buffers, _optimizer_tensors

    sleeper = backend.sleeper
    return Residency(
        asleep=lambda: sleeper.asleep,
        model_on_device=lambda: on_device(
            [b.param_data for b in _buffers(backend.model)] + list(backend.model.parameters())
        ),
        optimizer_on_device=lambda: on_device(_optimizer_tensors(backend.optimizer)),
        wakes=lambda: sleeper.wakes,
    )


def cycle_program(rank: int, world: int, hf_dir: str, engine_url: str, flags, out_file):
    from backend_reference import samples
    from colocated_testing import drive_cycle
    from megatron_ranks import BOTH_BACKENDS_FLAGS, layout_argv, parse
    from miles_core.batch import RolloutBatch
    from miles_megatron.backend import MegatronBackend

    backend = MegatronBackend()
    argv = ["--hf-checkpoint", hf_dir, *BOTH_BACKENDS_FLAGS, *layout_argv(tp=2), *flags]
    args = parse(argv)
    backend.init(args)
    try:
        train = lambda rollout_id: backend.train(rollout_id, RolloutBatch(samples()))  # noqa: E731
        drive_cycle(rank, world, backend, args, residency(backend), engine_url, train, out_file)
    finally:
        backend.close()


def run(tmp_path: Path, target: str) -> list[list[dict]]:
    hf_dir = make_tiny_hf("qwen3", tmp_path / "hf")
    engine_dir = engine_checkpoint(hf_dir, tmp_path / "engine_ckpt")
    flags = ["--offload-train", "--offload-rollout", "--offload-train-target", target]
    flags += ["--update-weight-buffer-size", "4096"]
    if target == "disk":
        flags += ["--offload-train-disk-dir", str(tmp_path / "offload")]
    out = tmp_path / "log.json"
    with_engine(
        engine_dir,
        lambda engine: spawn_ranks(
            cycle_program, 2, str(hf_dir), engine.url, flags, str(out), timeout=500
        ),
    )
    return json.loads(out.read_text())


@pytest.mark.extended
def test_megatron_colocated_cycle_residency_cpu(tmp_path):
    check_cycle(run(tmp_path, "cpu"))
