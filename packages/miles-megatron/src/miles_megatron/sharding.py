"""Between this rank's megatron parameters and the unsharded (global) layout the bridge speaks.

* Names: a rank's parameter ``decoder.layers.<i>`` is global layer ``offset + i`` (PP stage
  offset) and ``local_experts.<j>`` global expert ``ep_rank * experts_per_rank + j``.
* Tensors: a parameter with ``tensor_model_parallel`` set is split along its ``partition_dim``
  over the TP group (the expert-TP group for expert weights); a gated ``linear_fc1`` is split
  per half (``[gate_r; up_r]`` on rank ``r``). Vocabulary-parallel embeddings and output layers
  are split along rows like any column-parallel weight.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"\.experts\.local_experts\.(\d+)\.")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def is_lora_adapter(param: torch.Tensor) -> bool:
    """Whether ``param`` is a LoRA factor (marked by :mod:`miles_megatron.lora.layers`)."""
    return bool(getattr(param, "lora_adapter", False))


def is_expert_param(name: str) -> bool:
    return ".experts." in name


def _tp_group(name: str):
    if is_expert_param(name):
        return ps.get_expert_tensor_parallel_group()
    return ps.get_tensor_model_parallel_group()


def layer_offset(model: torch.nn.Module) -> int:
    """Global index of this PP stage's first decoder layer."""
    layers = unwrap(model).decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def global_name(name: str, model: torch.nn.Module, num_experts: int | None) -> str:
    """The global (TP = EP = PP = 1) name of this rank's parameter ``name``."""
    offset = layer_offset(model)
    found = _LAYER_RE.match(name)
    if found:
        name = f"decoder.layers.{int(found.group(1)) + offset}." + name[found.end() :]
    found = _EXPERT_RE.search(name)
    if found and num_experts:
        per_rank = num_experts // ps.get_expert_model_parallel_world_size()
        expert = ps.get_expert_model_parallel_rank() * per_rank + int(found.group(1))
        name = name[: found.start()] + f".experts.local_experts.{expert}." + name[found.end() :]
    return name


def _is_gated_fc1(name: str, param: torch.Tensor) -> bool:
    return name.endswith("linear_fc1.weight") or name.endswith("linear_fc1.bias")


def shard(full: torch.Tensor, name: str, param: torch.Tensor, gated: bool) -> torch.Tensor:
    """This rank's slice of the global tensor ``full`` for parameter ``param``."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    group = _tp_group(name)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    dim = param.partition_dim
    if gated and _is_gated_fc1(name, param):
        halves = torch.chunk(full, 2, dim=dim)
        return torch.cat([torch.chunk(h, size, dim=dim)[rank] for h in halves], dim=dim)
    return torch.chunk(full, size, dim=dim)[rank]


def gather(local: torch.Tensor, name: str, param: torch.Tensor, gated: bool) -> torch.Tensor:
    """The global tensor from every TP peer's ``local`` slice (collective over the TP group)."""
    if not getattr(param, "tensor_model_parallel", False):
        return local
    group = _tp_group(name)
    size = dist.get_world_size(group)
    if size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    dim = param.partition_dim
    if gated and _is_gated_fc1(name, param):
        halves = [torch.chunk(p, 2, dim=dim) for p in parts]
        gate = torch.cat([h[0] for h in halves], dim=dim)
        up = torch.cat([h[1] for h in halves], dim=dim)
        return torch.cat([gate, up], dim=dim)
    return torch.cat(parts, dim=dim)


def load_global_tensors(
    model: torch.nn.Module,
    full_tensor: Callable[[str], torch.Tensor],
    num_experts: int | None,
    gated: bool,
) -> int:
    """Copy ``full_tensor(global_name)`` (sliced for this rank) into every parameter.

    Returns the number of parameters filled. Shapes must match exactly. LoRA adapter
    parameters (:mod:`miles_megatron.lora`) are not base weights and are skipped.
    """
    module = unwrap(model)
    count = 0
    for name, param in module.named_parameters():
        if is_lora_adapter(param):
            continue
        gname = global_name(name, model, num_experts)
        local = shard(full_tensor(gname), name, param, gated)
        if local.shape != param.shape:
            raise ValueError(
                f"{gname}: shape {tuple(local.shape)} does not match the model's "
                f"{tuple(param.shape)} on this rank"
            )
        with torch.no_grad():
            param.copy_(local)
        count += 1
    return count


def iter_global_tensors(
    model: torch.nn.Module,
    num_experts: int | None,
    gated: bool,
    tensors: Callable[[str, torch.nn.Parameter], torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(global name, global tensor)`` of this PP stage's parameters, TP- and EP-gathered.

    Collective: every rank of the stage's TP and EP groups must iterate in step. Expert weights
    are all-gathered over the EP group, so each rank yields every expert of the stage.
    ``tensors(name, param)`` picks what to gather (default: the parameter itself). LoRA
    adapter parameters are skipped (base weights only).
    """
    module = unwrap(model)
    ep_group = ps.get_expert_model_parallel_group() if num_experts else None
    ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
    for name, param in module.named_parameters():
        if is_lora_adapter(param):
            continue
        value = tensors(name, param) if tensors else param.detach()
        full = gather(value, name, param, gated)
        if ep_size > 1 and is_expert_param(name):
            per_rank = num_experts // ep_size
            found = _EXPERT_RE.search(name)
            parts = [torch.empty_like(full) for _ in range(ep_size)]
            dist.all_gather(parts, full.contiguous(), group=ep_group)
            local = int(found.group(1))
            for ep_rank, part in enumerate(parts):
                gname = global_name(name, model, None)
                gname = (
                    gname[: _EXPERT_RE.search(gname).start()]
                    + f".experts.local_experts.{ep_rank * per_rank + local}."
                    + gname[_EXPERT_RE.search(gname).end() :]
                )
                yield gname, part
        else:
            yield global_name(name, model, num_experts), full
