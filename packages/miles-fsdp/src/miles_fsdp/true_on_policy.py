"""``--true-on-policy``'s dtype on this backend: the one the engine computes in.

The built-in engine under ``--true-on-policy`` computes in float32 on CPU and, on a GPU, in the
checkpoint's dtype (``--dtype auto``); the weights it receives are published in the
checkpoint's tensor dtypes. The trainer's forward must see the same weights in the same dtype:
on CPU it computes in fp32, on a GPU in the checkpoint's dtype (bf16 for the released Qwen3
checkpoints; its fp32 masters cast to bf16 are the published bits).
"""

from __future__ import annotations

import torch
from miles_core.args import ArgumentError

_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def check_true_on_policy_dtype(
    device: torch.device, compute: torch.dtype, tensor_dtypes: dict[str, torch.dtype]
) -> None:
    """One line when the compute dtype is not the engine's (see the module doc)."""
    name = _NAMES.get(compute, str(compute))
    if device.type == "cpu":
        if compute != torch.float32:
            raise ArgumentError(
                f"--true-on-policy computes in fp32 on CPU, and the compute dtype is {name} "
                "(add --fsdp-compute-dtype fp32)"
            )
        return
    stored = {d for d in tensor_dtypes.values() if d.is_floating_point}
    if stored != {compute}:
        names = ", ".join(sorted(_NAMES.get(d, str(d)) for d in stored))
        raise ArgumentError(
            f"--true-on-policy on a GPU computes in the checkpoint's dtype (the engine's), and "
            f"the checkpoint holds {names} while the compute dtype is {name}"
        )
