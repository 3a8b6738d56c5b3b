"""Test support: the spawned body of test_sleep_wake.py's failed-wake test (a Megatron wake
whose allocation fails, then a retry)."""

from __future__ import annotations

from typing import Any

import torch
from megatron_ranks import BOTH_BACKENDS_FLAGS, layout_argv, parse


def failed_wake_then_retry(rank: int, world: int, hf_dir: str) -> dict:
    """Train once, sleep; a wake whose second-to-last growth fails (torch.OutOfMemoryError from
    miles-offload's fault hook); then a wake without the fault. Returns the error's fields, the
    device bytes after the failure, and the weights before the sleep and after the retry."""
    from backend_reference import samples
    from miles_core.batch import RolloutBatch
    from miles_megatron.backend import MegatronBackend
    from miles_offload import allocation
    from miles_offload.allocation import WakeFailed

    backend = MegatronBackend()
    backend.init(parse(["--hf-checkpoint", hf_dir, *BOTH_BACKENDS_FLAGS, *layout_argv(tp=world)]))
    backend.train(0, RolloutBatch(samples()))
    before = {k: v.clone() for k, v in backend.hf_weights()}
    sizes = {}  # the DDP buffers' storages, measured awake
    for i, buffer in enumerate(backend.model.buffers):
        sizes[f"buffer{i}.param_data"] = buffer.param_data.untyped_storage().nbytes()
        sizes[f"buffer{i}.grad_data"] = buffer.grad_data.untyped_storage().nbytes()
    out: dict[str, Any] = {"failures": []}
    for stage_index in (0, -1):  # the first storage the wake grows (parameters), the last
        backend.sleep()
        keys = backend.sleeper._keys
        at = stage_index % len(keys)
        asked: list[int] = []

        def fail(nbytes: int, at=at, asked=asked) -> None:
            asked.append(nbytes)
            if len(asked) - 1 == at:
                raise torch.OutOfMemoryError(f"Tried to allocate {nbytes} bytes")

        allocation.fault_hook = fail
        try:
            backend.wake_up()
        except WakeFailed as error:
            out["failures"].append(
                {
                    "message": str(error),
                    "stage": error.stage,
                    "key": error.key,
                    "expected_key": keys[at],
                    "asked": asked[-1],
                    "expected_bytes": sizes.get(keys[at]),
                    "asleep": backend.sleeper.asleep,
                    "device_bytes": backend.sleeper.device_bytes(),
                }
            )
        finally:
            allocation.fault_hook = None
        backend.wake_up()
        after = dict(backend.hf_weights())
        out.setdefault("equal", []).append(
            sorted(before) == sorted(after)
            and all(torch.equal(before[k], after[k]) for k in before)
        )
    backend.close()
    return out
