"""Test support: per-rank bodies of the megatron memory tests (sleep/wake to disk, remat,
streamed optimizer state)."""

from __future__ import annotations

import errno
import os

import torch
from megatron_ranks import BOTH_BACKENDS_FLAGS, parse


def _backend(hf_dir: str, extra: list[str]):
    from miles_megatron.backend import MegatronBackend

    backend = MegatronBackend()
    backend.init(parse(["--hf-checkpoint", hf_dir, *BOTH_BACKENDS_FLAGS, *extra]))
    return backend


def _batch():
    from backend_reference import samples
    from miles_core.batch import RolloutBatch

    return RolloutBatch(samples())


def _weights(backend) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in backend.hf_weights()}


def _param_buffers(backend) -> list[torch.Tensor]:
    return [b.param_data.detach().clone() for b in backend.model.buffers]


STREAM_FLAGS = [
    "--stream-optimizer-state-to-disk", "--stream-optimizer-min-numel", "1000",
    "--stream-optimizer-bucket-numel", "20000",
]  # fmt: skip


def _adam_state(backend) -> dict[str, dict[str, torch.Tensor]]:
    """``shard name -> {master, exp_avg, exp_avg_sq}`` of every main-parameter shard."""
    from miles_megatron.streamed_optimizer import StreamedDistributedOptimizer, _shard_names

    out = {}
    opts = getattr(backend.optimizer, "chained_optimizers", [backend.optimizer])
    for opt in opts:
        names = _shard_names(opt)
        streamed = {n for _, n, _ in getattr(opt.optimizer, "_streamed", [])}
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                name = names[id(p)]
                if isinstance(opt, StreamedDistributedOptimizer) and name in streamed:
                    out[name] = opt.streamed.read_state(name)
                else:
                    state = opt.optimizer.state[p]
                    out[name] = {
                        "master": p.detach().view(-1).clone(),
                        "exp_avg": state["exp_avg"].view(-1).clone(),
                        "exp_avg_sq": state["exp_avg_sq"].view(-1).clone(),
                    }
    return out


def bf16_remat_and_streamed(rank: int, world: int, hf_dir: str, disk: str, save: str) -> dict:
    """bf16 model, 2 DP ranks: (1) train, sleep with remat (params not copied), wake, compare
    the parameter buffers, and again after a resume with --no-load-optim; (2) the streamed optimizer, whose fp32 master shards are released
    between steps; both trained 2 rollouts against a plain run."""
    batch = _batch()
    flags = ["--bf16", "--colocate", "--rematerialize-param-from-master-weight"]
    backend = _backend(hf_dir, [*flags, "--save", save])
    backend.train(0, batch)
    before = _param_buffers(backend)
    backend.sleep()
    out = {
        "dtypes": [str(b.dtype) for b in before],
        "asleep": backend.sleeper.device_bytes(),
        "host_bytes": backend.sleeper.host_bytes,
        "param_bytes": sum(b.untyped_storage().nbytes() for b in before),
    }
    backend.wake_up()
    out["bit_identical"] = all(torch.equal(a, b) for a, b in zip(before, _param_buffers(backend)))
    backend.train(1, batch)
    remat_weights = _weights(backend)
    backend.save_model(1)
    backend.close()

    # resumed without the optimizer state: the masters are rebuilt from the loaded weights, so
    # a rematerialising sleep/wake gives back the loaded weights, not the HF ones
    resumed = _backend(hf_dir, [*flags, "--load", save, "--no-load-optim"])
    loaded = _param_buffers(resumed)
    resumed.sleep()
    resumed.wake_up()
    out["resumed_remat_identical"] = all(
        torch.equal(a, b) for a, b in zip(loaded, _param_buffers(resumed))
    )
    out["resumed_loaded"] = all(
        torch.equal(v, remat_weights[k]) for k, v in _weights(resumed).items()
    )
    resumed.close()

    streamed = _backend(hf_dir, ["--bf16", *STREAM_FLAGS, "--offload-train-disk-dir", disk])
    opt = streamed.optimizer.chained_optimizers[0]
    for r in range(2):
        streamed.train(r, batch)
    out["released"] = len(opt._released) > 0 and all(
        shard.untyped_storage().nbytes() == 0 for shard, _ in opt._released
    )
    out["all_streamed"] = not opt.streamed._small
    streamed_weights = _weights(streamed)
    streamed.close()

    plain = _backend(hf_dir, ["--bf16"])
    for r in range(2):
        plain.train(r, batch)
    plain_weights = _weights(plain)
    plain.close()
    out["remat_equal"] = all(torch.equal(remat_weights[k], v) for k, v in plain_weights.items())
    out["streamed_equal"] = all(
        torch.equal(streamed_weights[k], v) for k, v in plain_weights.items()
    )
    return out


def fp32_disk_sleep_and_streamed(rank: int, world: int, hf_dir: str, disk: str, save: str) -> dict:
    """A plain run (in-memory distributed optimizer, never asleep) against the combination
    ``--offload-train-target disk --stream-optimizer-state-to-disk``: 2 rollouts (4 steps) with
    a sleep (twice) and wake (twice) in between; then a sleep into /dev/full (ENOSPC); a save,
    a 3rd rollout and a resumed run of the same 3rd rollout; an in-memory run refusing the
    streamed checkpoint."""
    from miles_megatron.sleep_wake import SleepWake
    from miles_offload.offload_target import OffloadTarget

    batch = _batch()
    plain = _backend(hf_dir, [])
    plain_losses = [plain.train(r, batch)["loss"] for r in range(2)]
    plain_state, plain_weights = _adam_state(plain), _weights(plain)
    plain.close()

    flags = ["--offload-train", "--offload-train-target", "disk", "--offload-train-disk-dir", disk]
    flags += ["--offload-train-disk-chunk-mb", "1", *STREAM_FLAGS]
    run = _backend(hf_dir, [*flags, "--save", save])
    inner = run.optimizer.chained_optimizers[0].streamed
    out = {"buckets": len(inner.buckets), "streamed": len(inner._streamed)}
    out["small"] = len(inner._small)
    losses = [run.train(0, batch)["loss"]]
    out["awake"] = run.sleeper.device_bytes()
    out["grad_bytes"] = sum(b.grad_data.untyped_storage().nbytes() for b in run.model.buffers)
    run.sleep()
    run.sleep()
    out["asleep"] = run.sleeper.device_bytes()
    out["file_bytes"] = os.path.getsize(run.sleeper.disk_path)
    out["host_bytes"] = run.sleeper.host_bytes
    run.wake_up()
    run.wake_up()
    losses.append(run.train(1, batch)["loss"])
    state, weights = _adam_state(run), _weights(run)
    out["losses_equal"] = losses == plain_losses
    out["names_equal"] = sorted(state) == sorted(plain_state)
    out["state_equal"] = {
        key: all(torch.equal(state[n][key], plain_state[n][key]) for n in plain_state)
        for key in ("master", "exp_avg", "exp_avg_sq")
    }
    out["weights_equal"] = all(torch.equal(weights[k], v) for k, v in plain_weights.items())

    bad_dir = os.path.join(disk, f"full{rank}")
    os.makedirs(bad_dir)
    full = os.path.join(bad_dir, f"miles-offload-{os.getpid()}-rank{rank}-megatron.bin")
    os.symlink("/dev/full", full)  # every write fails with ENOSPC
    before = _param_buffers(run)
    failing = SleepWake(run.model, run.optimizer, OffloadTarget("disk", bad_dir, chunk_mb=1))
    try:
        failing.sleep()
        out["enospc"] = None
    except OSError as error:
        out["enospc"] = error.errno == errno.ENOSPC and error.filename == full
        out["enospc_message"] = str(error)
    out["intact"] = not failing.asleep and all(
        torch.equal(a, b) for a, b in zip(before, _param_buffers(run))
    )
    out["still_awake_bytes"] = run.sleeper.device_bytes() == out["awake"]

    run.save_model(1)
    continued = run.train(2, batch)["loss"]
    continued_weights = _weights(run)
    path = run.sleeper.disk_path
    run.close()
    out["file_removed"] = not os.path.exists(path)

    resumed = _backend(hf_dir, [*flags, "--load", save])
    out["resumed_equal"] = resumed.train(2, batch)["loss"] == continued and all(
        torch.equal(v, continued_weights[k]) for k, v in _weights(resumed).items()
    )
    resumed.close()
    try:
        _backend(hf_dir, ["--load", save])
        out["in_memory_refused"] = None
    except ValueError as error:
        out["in_memory_refused"] = str(error)
    return out
