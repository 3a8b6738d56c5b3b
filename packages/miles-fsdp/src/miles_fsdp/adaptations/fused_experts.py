"""Unfuse transformers' batched expert tensors into the per-expert names checkpoints use.

transformers >= 5 merges a released checkpoint's per-expert linears into 3-D parameters at load
time. Weight sync and export must speak the checkpoint's language again:

* ``<p>.experts.gate_up_proj`` ``(E, 2I, H)`` -> ``<p>.experts.{e}.gate_proj.weight`` = rows
  ``[:I]`` of expert ``e``, ``<p>.experts.{e}.up_proj.weight`` = rows ``[I:]``;
* ``<p>.experts.up_proj`` ``(E, I, H)`` -> ``<p>.experts.{e}.up_proj.weight`` (ungated MLPs);
* ``<p>.experts.down_proj`` ``(E, H, I)`` -> ``<p>.experts.{e}.down_proj.weight``.
"""

from __future__ import annotations

from typing import Any

import torch

GATE_UP = ".experts.gate_up_proj"
UP = ".experts.up_proj"
DOWN = ".experts.down_proj"


def unfuse_experts(name: str, tensor: torch.Tensor, config: Any) -> list | None:
    """Param transform: split one fused expert tensor into per-expert checkpoint tensors."""
    if name.endswith(GATE_UP):
        prefix = name[: -len(GATE_UP)] + ".experts"
        gate, up = tensor.chunk(2, dim=1)
        out = []
        for e in range(tensor.shape[0]):
            out.append((f"{prefix}.{e}.gate_proj.weight", gate[e]))
            out.append((f"{prefix}.{e}.up_proj.weight", up[e]))
        return out
    for suffix, proj in ((UP, "up_proj"), (DOWN, "down_proj")):
        if name.endswith(suffix):
            prefix = name[: -len(suffix)] + ".experts"
            return [(f"{prefix}.{e}.{proj}.weight", tensor[e]) for e in range(tensor.shape[0])]
    return None
