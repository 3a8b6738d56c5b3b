"""The training dtype of a run, one meaning on every backend.

``--bf16`` (the default), ``--fp16`` or ``--no-bf16`` (fp32) pick the dtype the model computes
in; the master weights and optimizer state are fp32 on both backends (the FSDP backend's
``--no-keep-fp32-master`` holds them in the compute dtype instead). A backend-specific dtype flag
refines this choice (``--fsdp-compute-dtype`` when neither ``--bf16``, ``--no-bf16`` nor
``--fp16`` is given) and is refused when it contradicts it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from miles_core.args.parsed import ParsedArgs

if TYPE_CHECKING:
    import torch


def _dtypes() -> dict[str, torch.dtype]:
    import torch  # here, not at the top: parsing a command line must not import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def __getattr__(name: str) -> Any:
    """``DTYPES`` (name -> torch dtype), built on first use."""
    if name == "DTYPES":
        return _dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def train_dtype_name(args: ParsedArgs) -> str:
    """``"fp16"`` with ``--fp16``, ``"fp32"`` with ``--no-bf16``, else ``"bf16"``."""
    if args.fp16:
        return "fp16"
    if args.bf16 is False:
        return "fp32"
    return "bf16"


def explicit_dtype_name(args: ParsedArgs) -> str | None:
    """The dtype the command line names with ``--bf16`` / ``--no-bf16`` / ``--fp16``, or None
    when it names none (the default, bf16)."""
    if args.fp16 or args.bf16 is not None:
        return train_dtype_name(args)
    return None


def train_dtype(args: ParsedArgs) -> torch.dtype:
    """The compute dtype of :func:`train_dtype_name`."""
    return _dtypes()[train_dtype_name(args)]
