"""Precision policy: which dtype computes, which holds the master weights, which reduces.

* compute (``param_dtype`` of FSDP's MixedPrecisionPolicy): miles-core's training dtype
  (:mod:`miles_core.precision`: bf16 by default, fp16 with ``--fp16``, fp32 with
  ``--no-bf16``), the same as the Megatron backend's; ``--fsdp-compute-dtype`` picks it when
  none of those is given and is refused when it contradicts them;
* master: the dtype the sharded parameters and AdamW state live in; fp32 by default,
  the compute dtype with ``--no-keep-fp32-master``;
* gradient reduction (reduce-scatter / all-reduce): always fp32;
* per module (``module_compute_dtypes``): modules of the named classes compute in their own
  dtype, e.g. an MoE router kept in fp32 under a bf16 run. Each such module becomes its own
  FSDP unit (:func:`miles_fsdp.wrapping.apply_fsdp`) whose parameters are all-gathered in that
  dtype and whose inputs are cast to it.

An architecture may replace the policy through ``register_precision_policy`` (adaptations),
e.g. ``dataclasses.replace(precision, module_compute_dtypes={"MyRouter": torch.float32})``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from miles_core.precision import DTYPES, train_dtype_name
from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["DTYPES", "PrecisionConfig", "precision_of", "resolve_precision"]


@dataclass(frozen=True)
class PrecisionConfig:
    """The three dtypes of a run, and the modules that compute in a dtype of their own."""

    compute_dtype: torch.dtype
    master_dtype: torch.dtype
    reduce_dtype: torch.dtype = torch.float32
    #: class name -> compute dtype of the modules of that class (their own FSDP units)
    module_compute_dtypes: dict[str, torch.dtype] = field(default_factory=dict)

    def mixed_precision_policy(
        self, compute_dtype: torch.dtype | None = None
    ) -> MixedPrecisionPolicy:
        """FSDP2 policy: unshard to ``compute_dtype``, reduce gradients in ``reduce_dtype``.

        The run's policy (``compute_dtype`` not given) leaves ``param_dtype`` unset when master
        and compute dtypes agree (no cast needed). A module's own dtype is always set, so that
        its inputs are cast to it (FSDP casts forward inputs only under a ``param_dtype``).
        """
        if compute_dtype is None:
            compute = self.compute_dtype
            param_dtype = None if compute == self.master_dtype else compute
        else:
            param_dtype = compute_dtype
        return MixedPrecisionPolicy(
            param_dtype=param_dtype,
            reduce_dtype=self.reduce_dtype,
            output_dtype=None,
            cast_forward_inputs=True,
        )


def resolve_precision(
    train_dtype: str = "bf16", compute_dtype: str | None = None, keep_fp32_master: bool = True
) -> PrecisionConfig:
    """Derive the precision of a run from its flags.

    ``train_dtype`` is miles-core's (:func:`miles_core.precision.train_dtype_name`);
    ``compute_dtype`` (``--fsdp-compute-dtype``) wins when given (the argument checks refuse it
    when it contradicts an explicit ``--bf16`` / ``--no-bf16`` / ``--fp16``). The master dtype
    is fp32 when ``keep_fp32_master``, else the compute dtype.
    """
    for name, flag in ((train_dtype, "--bf16/--fp16"), (compute_dtype, "--fsdp-compute-dtype")):
        if name is not None and name not in DTYPES:
            raise ValueError(f"{flag} must be one of {sorted(DTYPES)}, got {name!r}")
    compute = DTYPES[compute_dtype if compute_dtype is not None else train_dtype]
    master = torch.float32 if keep_fp32_master else compute
    return PrecisionConfig(compute_dtype=compute, master_dtype=master)


def precision_of(args) -> PrecisionConfig:
    """:func:`resolve_precision` of the parsed flags."""
    return resolve_precision(train_dtype_name(args), args.fsdp_compute_dtype, args.keep_fp32_master)
