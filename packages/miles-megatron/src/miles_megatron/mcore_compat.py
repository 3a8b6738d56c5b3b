"""Compatibility fixes for megatron-core releases this package supports (0.16 - 0.19).

Each fix is applied by :func:`apply` (idempotent), only where the installed release needs it.

* megatron-core 0.16.x without TransformerEngine: ``moe_utils.RouterGatingLinearFunction``
  reads the module global ``te_general_gemm``, which is only bound when TransformerEngine
  imports, so every MoE router forward raises ``NameError``. Binding it to ``None`` selects the
  plain ``torch`` matmul path the function already has.
"""

from __future__ import annotations


def apply() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
