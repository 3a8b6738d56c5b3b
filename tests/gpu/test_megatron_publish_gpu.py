"""MegatronBackend publishing to the built-in engine on GPUs (NCCL), the check of the CPU test
tests/miles_megatron/test_publish.py in both transfer modes:

* ``broadcast`` (default, not colocated): TP = world (``--sequence-parallel`` when TP > 1) trains
  one rollout and publishes to one engine on the last GPU over an NCCL weight-update group with
  trainer rank 0 (so it needs 2 GPUs: NCCL cannot put two ranks of one group on one device).
* ``ipc`` (``--colocate``): TP = 1, DP = world, one engine on every trainer rank's GPU; each rank
  hands its buckets over as CUDA IPC handles (miles_sync.ipc: one trainer rank per engine GPU).

After the publish every engine serves ``w.to(bfloat16)`` of every weight its trainer rank's
``hf_weights()`` yields after training, bit for bit (xxh3-128 of the raw bytes, read through the
``/weights_digest`` route of tests/miles_sync/digest_engine.py); every one of those tensors
differs from the served checkpoint (a stale tensor would show); ``/get_model_info``'s
``weight_version`` advanced by exactly one and a greedy generation reports that version.

The trainer loads the fp32 tiny qwen3 (its master copy); the engines serve a bf16 copy of the
same checkpoint. Without CUDA the same rank code runs on gloo with the megatron CPU shim and CPU
engines (``ipc`` then shares file-system shared memory), which is how it is validated on CPU::

    uv run torchrun --nproc-per-node 2 tests/gpu/test_megatron_publish_gpu.py /tmp/mpub broadcast ipc

Run on 1 or 2 H200s through pytest (which starts torchrun itself, world = min(2, GPUs))::

    python3 -m pytest tests/gpu/test_megatron_publish_gpu.py -v
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).parents[1]
SUPPORT = [str(TESTS / "miles_megatron"), str(TESTS / "miles_sync")]
ENGINE_DTYPE = torch.bfloat16
PASSED = "megatron publish checks passed:"
TORCHRUN_TIMEOUT_S = 200  # + 60 s to stop: inside the 300 s of pytest-timeout below

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _prepare(work: Path) -> tuple[str, Path]:
    """The trainer's fp32 tiny qwen3 and the engine's bf16 copy of it (with a tokenizer)."""
    from megatron_tiny_models import make_tiny_hf
    from sync_testing import save_tokenizer
    from transformers import AutoModelForCausalLM

    hf_dir = make_tiny_hf("qwen3", work / "hf")
    engine_dir = work / "engine_ckpt"
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=ENGINE_DTYPE)
    model.save_pretrained(engine_dir)
    save_tokenizer(engine_dir)
    return str(hf_dir), engine_dir


def _mode_argv(mode: str, world: int) -> list[str]:
    from megatron_ranks import layout_argv

    if mode == "broadcast":
        return ["--update-weight-transfer-mode", "broadcast", *layout_argv(tp=world)]
    if mode == "ipc":
        return ["--colocate", "--update-weight-transfer-mode", "ipc", *layout_argv(tp=1)]
    raise ValueError(f"mode must be broadcast or ipc, got {mode!r}")


def _engine_device(mode: str, rank: int, world: int) -> str | None:
    """Where this rank's engine runs, or None when this rank owns no engine."""
    if mode == "broadcast" and rank != 0:
        return None
    if not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{world - 1}" if mode == "broadcast" else f"cuda:{rank}"


def _cast_digests(weights: dict[str, torch.Tensor]) -> dict[str, list]:
    """The ``/weights_digest`` entries an engine serving ``weights`` in bf16 returns."""
    from digest_engine import digests

    return digests({name: tensor.to(ENGINE_DTYPE) for name, tensor in weights.items()})


def check_publish(work: Path, mode: str) -> None:
    """On every rank (collective): start this rank's engine (if it owns one), train one rollout,
    ``update_weights``, then compare the engine against this rank's trained HF weights. Every
    rank's failures are gathered, so all ranks raise together instead of hanging."""
    import torch.distributed as dist
    from backend_reference import samples
    from megatron_ranks import BOTH_BACKENDS_FLAGS, parse
    from miles_core.batch import RolloutBatch
    from miles_megatron.backend import MegatronBackend
    from sync_testing import Engine

    rank, world = dist.get_rank(), dist.get_world_size()
    hf_dir, engine_dir = str(work / "hf"), work / "engine_ckpt"
    device = _engine_device(mode, rank, world)
    engine = Engine(engine_dir, device=device, timeout=300) if device is not None else None
    pid_file = work / f"engine-{mode}-rank{rank}.pid"
    if engine is not None:
        pid_file.write_text(str(engine.proc.pid))  # for the driver, should this rank be killed
    try:
        urls = [None] * world
        dist.all_gather_object(urls, engine.url if engine is not None else None)
        urls = [url for url in urls if url is not None]
        served = engine.digests() if engine is not None else None
        before = engine.version() if engine is not None else None

        args = parse(["--hf-checkpoint", hf_dir, *BOTH_BACKENDS_FLAGS, *_mode_argv(mode, world)])
        backend = MegatronBackend()
        backend.init(args)
        initial = {k: v.detach().cpu().clone() for k, v in backend.hf_weights()}
        backend.train(0, RolloutBatch(samples()))
        trained = {k: v.detach().cpu().clone() for k, v in backend.hf_weights()}
        backend.update_weights(urls)
        backend.close()
        dist.barrier()  # every rank's share has landed before any engine is read

        failures = []
        if engine is not None:
            try:
                failures = _engine_failures(engine, served, before, initial, trained)
            except Exception as error:  # an engine that fails a request: reported by all ranks
                failures = [f"{type(error).__name__}: {error}"]
    finally:
        if engine is not None:
            engine.close()
            pid_file.unlink()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, failures)
    report = [f"rank {r} ({mode}): {f}" for r, fs in enumerate(everyone) for f in fs]
    assert not report, "\n".join(report)


def _engine_failures(engine, served, before, initial, trained) -> list[str]:
    """What differs between ``engine`` after the publish and the trainer rank's weights."""
    failures = []
    dtypes = {entry[1] for entry in served.values()}
    if dtypes != {str(ENGINE_DTYPE)}:
        failures.append(f"the engine serves {dtypes}, not {ENGINE_DTYPE}")
    if served != _cast_digests(initial):
        failures.append("before the publish, the engine did not serve the checkpoint")
    want = _cast_digests(trained)
    unmoved = sorted(k for k in want if want[k] == served.get(k))
    if unmoved:
        failures.append(
            f"training left these unchanged in bf16 (a stale one would hide): {unmoved}"
        )
    got = engine.digests()
    if sorted(got) != sorted(want):
        failures.append(f"names differ: {sorted(set(got) ^ set(want))}")
    wrong = sorted(k for k in want if got.get(k) != want[k])
    if wrong:
        failures.append(f"not bit for bit the trained bf16 weights: {wrong}")
    expected_version = str(int(before) + 1 if before.isdigit() else 1)
    if engine.version() != expected_version:
        failures.append(f"weight_version {engine.version()}, want {expected_version}")
    ids, _ = engine.greedy([1, 2, 3], 4)  # asserts the reply carries the live version
    if len(ids) != 4:
        failures.append(f"greedy generated {len(ids)} tokens, want 4")
    return failures


def main(work: str, modes: list[str]) -> None:
    """torchrun entry: NCCL on the GPUs when there are any, else gloo with the megatron shim."""
    import datetime

    import torch.distributed as dist

    # torchrun stops the other ranks with SIGTERM when one fails: exit through the finally
    # blocks, so that no engine outlives its rank
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    for path in SUPPORT:
        sys.path.insert(0, path)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        import megatron_shim

        torch.set_num_threads(1)
        megatron_shim.install()
    # a rank stuck in a collective fails after 5 minutes instead of hanging
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=5))
    root = Path(work)
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        _prepare(root)
    dist.barrier()
    for mode in modes:
        check_publish(root, mode)
    dist.barrier()
    if dist.get_rank() == 0:
        print(PASSED, " ".join(modes), flush=True)
    dist.destroy_process_group()


def _gpu_modes() -> list[str]:
    modes = ["ipc"]
    if torch.cuda.device_count() >= 2:
        modes.append("broadcast")
    return modes


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGTERM torchrun, which passes it to the ranks (each in its own session); they leave
    through their finally blocks and kill their engines. SIGKILL after a minute."""
    proc.terminate()
    try:
        return proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()


def _kill_orphaned_engines(work: Path) -> None:
    """Kill the engines whose rank died before its finally block (their pid files remain)."""
    for pid_file in work.glob("engine-*.pid"):
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass
        pid_file.unlink()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["broadcast", "ipc"])
def test_megatron_publish_under_torchrun(mode, tmp_path):
    pytest.importorskip("megatron.core")
    if mode not in _gpu_modes():
        pytest.skip("NCCL broadcast needs the engine on a second GPU")
    world = min(2, torch.cuda.device_count())
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}"]
    cmd += [__file__, str(tmp_path), mode]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=TORCHRUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stdout, stderr = _stop(proc)
        pytest.fail(
            f"torchrun did not finish in {TORCHRUN_TIMEOUT_S} s:\n{stdout[-4000:]}{stderr[-8000:]}"
        )
    finally:
        if proc.poll() is None:  # interrupted (pytest-timeout, Ctrl-C)
            _stop(proc)
        _kill_orphaned_engines(tmp_path)
    assert proc.returncode == 0, stdout[-4000:] + stderr[-8000:]
    assert f"{PASSED} {mode}" in stdout


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
