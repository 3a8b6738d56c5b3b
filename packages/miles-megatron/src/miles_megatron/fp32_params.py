"""``mark_param_dtype``: keep chosen parameters in a dtype through megatron's bf16/fp16 cast.

megatron-core's ``Float16Module`` casts the whole model to bf16 (or fp16). A custom module
whose numerics need fp32 (a router, a gating vector, a state-space decay) marks its parameters
at construction::

    mark_param_dtype(self.A_log, torch.float32)

and :func:`restore_marked_dtypes` (run by the backend right after the cast, before the DDP
buffers are laid out) puts them back. The DDP wrapper keeps a separate buffer per dtype, so the
marked parameters also get fp32 gradients.
"""

from __future__ import annotations

import torch

MARK_ATTRIBUTE = "_miles_param_dtype"


def mark_param_dtype(param: torch.nn.Parameter, dtype: torch.dtype) -> torch.nn.Parameter:
    """Keep ``param`` in ``dtype`` through the model-wide precision cast. Returns ``param``."""
    if not isinstance(param, torch.nn.Parameter):
        raise TypeError(f"mark_param_dtype needs an nn.Parameter, got {type(param).__name__}")
    setattr(param, MARK_ATTRIBUTE, dtype)
    return param


def marked_dtype(param: torch.nn.Parameter) -> torch.dtype | None:
    """The dtype ``param`` was marked with, or None."""
    return getattr(param, MARK_ATTRIBUTE, None)


def restore_marked_dtypes(module: torch.nn.Module) -> int:
    """Cast every marked parameter of ``module`` back to its dtype; returns how many."""
    count = 0
    for param in module.parameters():
        dtype = marked_dtype(param)
        if dtype is not None and param.dtype != dtype:
            param.data = param.data.to(dtype)
            count += 1
    return count
