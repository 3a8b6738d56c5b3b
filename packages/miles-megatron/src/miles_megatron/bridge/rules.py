"""Weight rules: how one megatron parameter is made of HuggingFace tensors, and back.

Megatron names here are *global* names of the unsharded model (TP = EP = 1 layout, the local
layer spec): ``decoder.layers.3.self_attention.linear_qkv.weight``,
``decoder.layers.0.mlp.experts.local_experts.7.linear_fc1.weight`` (7 is the global expert).

Layouts (``kind``):

* ``copy``: the same tensor.
* ``vocab``: the HF ``[vocab, hidden]`` tensor, zero-padded to megatron's padded vocabulary.
* ``qkv``: fused attention input projection. With ``g`` query groups, ``n = heads / g`` query
  heads per group and head size ``d``, the rows are ordered group by group:
  ``[q_0 .. q_{n-1}, k, v]`` for group 0, then group 1, ... (``(n + 2) * d`` rows per group).
  Each TP rank owns whole groups, so the TP shard of this layout is a contiguous slice.
* ``gate_up``: gated MLP input ``fc1 = [gate; up]`` (rows ``0 .. ffn-1`` gate, ``ffn ..`` up).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

Kind = Literal["copy", "vocab", "qkv", "gate_up"]


@dataclass(frozen=True)
class AttentionShape:
    """Sizes the ``qkv`` layout needs."""

    num_heads: int
    num_groups: int
    head_dim: int


@dataclass(frozen=True)
class WeightRule:
    """One megatron parameter pattern and the HF tensor names it is made of.

    ``megatron`` and every ``hf`` entry may hold ``{layer}`` and ``{expert}`` placeholders.
    """

    megatron: str
    hf: tuple[str, ...]
    kind: Kind = "copy"

    def regex(self) -> re.Pattern[str]:
        pattern = re.escape(self.megatron)
        pattern = pattern.replace(r"\{layer\}", r"(?P<layer>\d+)")
        pattern = pattern.replace(r"\{expert\}", r"(?P<expert>\d+)")
        return re.compile("^" + pattern + "$")

    def hf_names(self, layer: int | None = None, expert: int | None = None) -> list[str]:
        return [name.format(layer=layer, expert=expert) for name in self.hf]


def merge_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: AttentionShape
) -> torch.Tensor:
    """HF ``q [H*d, ...]``, ``k``/``v`` ``[g*d, ...]`` -> megatron's group-interleaved rows."""
    n = shape.num_heads // shape.num_groups
    d = shape.head_dim
    rest = q.shape[1:]
    q = q.reshape(shape.num_groups, n * d, *rest)
    k = k.reshape(shape.num_groups, d, *rest)
    v = v.reshape(shape.num_groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(shape.num_groups * (n + 2) * d, *rest)


def split_qkv(qkv: torch.Tensor, shape: AttentionShape) -> tuple[torch.Tensor, ...]:
    """Inverse of :func:`merge_qkv`."""
    n = shape.num_heads // shape.num_groups
    d = shape.head_dim
    rest = qkv.shape[1:]
    grouped = qkv.reshape(shape.num_groups, (n + 2) * d, *rest)
    q, k, v = torch.split(grouped, [n * d, d, d], dim=1)
    return (
        q.reshape(shape.num_groups * n * d, *rest).contiguous(),
        k.reshape(shape.num_groups * d, *rest).contiguous(),
        v.reshape(shape.num_groups * d, *rest).contiguous(),
    )


def to_megatron(
    rule: WeightRule,
    tensors: list[torch.Tensor],
    attention: AttentionShape,
    padded_vocab_size: int,
) -> torch.Tensor:
    """Build the megatron tensor of ``rule`` from its HF tensors (in ``rule.hf`` order)."""
    if rule.kind == "copy":
        return tensors[0]
    if rule.kind == "vocab":
        (weight,) = tensors
        if weight.shape[0] > padded_vocab_size:
            raise ValueError(
                f"{rule.hf[0]}: vocabulary {weight.shape[0]} exceeds padded size {padded_vocab_size}"
            )
        padded = weight.new_zeros(padded_vocab_size, *weight.shape[1:])
        padded[: weight.shape[0]] = weight
        return padded
    if rule.kind == "qkv":
        return merge_qkv(*tensors, attention)
    if rule.kind == "gate_up":
        return torch.cat(tensors, dim=0)
    raise ValueError(f"unknown weight rule kind {rule.kind!r}")


def to_hf(
    rule: WeightRule, tensor: torch.Tensor, attention: AttentionShape, vocab_size: int
) -> list[torch.Tensor]:
    """Split the megatron tensor of ``rule`` into its HF tensors (in ``rule.hf`` order)."""
    if rule.kind == "copy":
        return [tensor]
    if rule.kind == "vocab":
        return [tensor[:vocab_size]]
    if rule.kind == "qkv":
        return list(split_qkv(tensor, attention))
    if rule.kind == "gate_up":
        return list(torch.chunk(tensor, 2, dim=0))
    raise ValueError(f"unknown weight rule kind {rule.kind!r}")


def match_rule(
    rules: list[WeightRule], name: str
) -> tuple[WeightRule, int | None, int | None] | None:
    """The rule whose megatron pattern matches ``name``, with the layer and expert numbers."""
    for rule in rules:
        found = rule.regex().match(name)
        if found:
            groups = found.groupdict()
            layer = int(groups["layer"]) if groups.get("layer") is not None else None
            expert = int(groups["expert"]) if groups.get("expert") is not None else None
            return rule, layer, expert
    return None


HFGetter = Callable[[str], torch.Tensor]
HFMapping = Mapping[str, torch.Tensor]
