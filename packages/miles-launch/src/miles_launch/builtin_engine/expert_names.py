"""Per-expert checkpoint names onto transformers' batched expert parameters.

Checkpoints on disk and the trainers' weight sync name every expert's linears on their own
(``<p>.experts.{e}.gate_proj.weight``, ...), while transformers >= 5 holds a MoE block's
experts batched in 3-D parameters. The tensor of a per-expert name is a slice of one of them:

* ``<p>.experts.{e}.gate_proj.weight`` ``(I, H)`` -> ``<p>.experts.gate_up_proj[e, :I]``
  (``gate_up_proj`` is ``(E, 2I, H)``, gate rows first);
* ``<p>.experts.{e}.up_proj.weight`` ``(I, H)`` -> ``<p>.experts.gate_up_proj[e, I:]``, or
  ``<p>.experts.up_proj[e]`` for ungated experts;
* ``<p>.experts.{e}.down_proj.weight`` ``(H, I)`` -> ``<p>.experts.down_proj[e]``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

PER_EXPERT = re.compile(
    r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


def batched_expert_slice(name: str, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The view of a batched expert parameter in ``tensors`` that the per-expert checkpoint
    tensor ``name`` is (see the module docstring), or None when ``name`` is not one."""
    match = PER_EXPERT.match(name)
    if match is None:
        return None
    prefix, proj = match["prefix"], match["proj"]
    expert = int(match["expert"])
    gate_up = tensors.get(f"{prefix}.gate_up_proj")
    if proj in ("gate_proj", "up_proj") and gate_up is not None:
        if expert >= gate_up.shape[0]:
            return None
        half = gate_up.shape[1] // 2
        return gate_up[expert, :half] if proj == "gate_proj" else gate_up[expert, half:]
    batched = tensors.get(f"{prefix}.{proj}")
    if batched is None or batched.dim() != 3 or expert >= batched.shape[0]:
        return None
    return batched[expert]
