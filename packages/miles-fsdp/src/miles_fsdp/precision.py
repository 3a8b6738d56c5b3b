"""Precision policy: which dtype computes, which holds the master weights, which reduces.

* compute (``param_dtype`` of FSDP's MixedPrecisionPolicy): bf16 by default, fp16 with
  ``--fp16``, fp32 with ``--fsdp-compute-dtype fp32`` (used by CPU tests and numerics checks);
* master: the dtype the sharded parameters and AdamW state live in; fp32 by default,
  the compute dtype with ``--no-keep-fp32-master``;
* gradient reduction (reduce-scatter / all-reduce): always fp32.

An architecture may replace the policy through ``register_precision_policy`` (adaptations).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}


@dataclass(frozen=True)
class PrecisionConfig:
    """The three dtypes of a run."""

    compute_dtype: torch.dtype
    master_dtype: torch.dtype
    reduce_dtype: torch.dtype = torch.float32

    def mixed_precision_policy(self) -> MixedPrecisionPolicy:
        """FSDP2 policy: unshard to ``compute_dtype``, reduce gradients in ``reduce_dtype``.

        When master and compute dtypes agree no cast is needed and ``param_dtype`` is left unset.
        """
        param_dtype = None if self.compute_dtype == self.master_dtype else self.compute_dtype
        return MixedPrecisionPolicy(
            param_dtype=param_dtype,
            reduce_dtype=self.reduce_dtype,
            output_dtype=None,
            cast_forward_inputs=True,
        )


def resolve_precision(
    fp16: bool, compute_dtype: str | None = None, keep_fp32_master: bool = True
) -> PrecisionConfig:
    """Derive the precision of a run from its flags.

    ``compute_dtype`` (``--fsdp-compute-dtype``) wins when given; otherwise fp16 if ``fp16`` else
    bf16. The master dtype is fp32 when ``keep_fp32_master``, else the compute dtype.
    """
    if compute_dtype is not None:
        if compute_dtype not in DTYPES:
            raise ValueError(
                f"--fsdp-compute-dtype must be one of {sorted(DTYPES)}, got {compute_dtype!r}"
            )
        compute = DTYPES[compute_dtype]
    else:
        compute = torch.float16 if fp16 else torch.bfloat16
    master = torch.float32 if keep_fp32_master else compute
    return PrecisionConfig(compute_dtype=compute, master_dtype=master)
