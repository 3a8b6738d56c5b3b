"""What a sleep moves: the device tensors of a set of modules and of their optimizers.

Each :class:`MovedTensor` pairs the object a module or optimizer holds (a Parameter, a
buffer, an optimizer state value) with the contiguous ``source`` whose bytes move:

- an FSDP2-managed parameter moves its padded shard (``FSDPParam._sharded_param_data``,
  1-D, ``padded_sharded_param_size`` elements), so uneven shards keep their padding and
  FSDP's all-gather input stays one contiguous tensor;
- any other DTensor moves its local tensor; a plain tensor moves itself.

Tensors are deduplicated by identity, so tied weights (one Parameter registered twice)
move once and stay tied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


@dataclass(eq=False)
class MovedTensor:
    key: str  # for messages: "model.layers.0.weight", "optimizer0.state[3].exp_avg"
    tensor: torch.Tensor  # what the module/optimizer holds
    source: torch.Tensor  # whose bytes move (contiguous unless `tensor` is a strided plain tensor)
    fsdp_param: Any | None = None  # torch's FSDPParam when FSDP2 manages `tensor`

    @property
    def nbytes(self) -> int:
        return self.source.numel() * self.source.element_size()

    def rebuild(self, new_source: torch.Tensor) -> torch.Tensor:
        """The value to hold instead of ``tensor`` once its bytes live in ``new_source``.

        ``new_source`` has ``source``'s shape and dtype (contiguous). For an FSDP parameter
        this also points FSDP's padded shard at ``new_source``, so that the reset FSDP runs
        after ``Module._apply`` finds the local tensor already inside it and keeps it.
        """
        if self.fsdp_param is not None:
            fp = self.fsdp_param
            dim = fp.fsdp_placement.dim
            local = self.tensor._local_tensor
            length = local.size(dim) if local.numel() > 0 else 0
            fp._sharded_param_data = new_source.view(-1)
            padded = new_source.view(fp.padded_sharded_param_size)
            return DTensor(
                padded.narrow(dim, 0, length),
                self.tensor._spec,
                requires_grad=self.tensor.requires_grad,
            )
        if isinstance(self.tensor, DTensor):
            return DTensor(new_source, self.tensor._spec, requires_grad=self.tensor.requires_grad)
        return new_source


def byte_window(t: torch.Tensor) -> tuple[int, int]:
    """``(first byte, byte count)`` of the part of ``t``'s storage that ``t`` spans."""
    size = t.element_size()
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0
    return t.storage_offset() * size, extent * size


def from_window(window: torch.Tensor, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new tensor on ``device`` with ``t``'s shape, dtype and strides whose values are
    ``window`` (``uint8``, the bytes of ``t``'s :func:`byte_window`, wherever they are held)."""
    out = torch.empty(window.numel(), dtype=torch.uint8, device=device)
    out.copy_(window)
    return out.view(t.dtype).as_strided(t.shape, t.stride(), 0)


def tensor_device(t: torch.Tensor) -> torch.device:
    return t._local_tensor.device if isinstance(t, DTensor) else t.device


def _param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups: a list in newer torch (2.13), one optional group in 2.11."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def fsdp_params_by_id(module: nn.Module) -> dict[int, Any]:
    """``id(sharded parameter) -> FSDPParam`` for every FSDP2 unit inside ``module``."""
    found: dict[int, Any] = {}
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        for group in _param_groups(sub._get_fsdp_state()):
            for fp in group.fsdp_params:
                found[id(fp.sharded_param)] = fp
    return found


def fsdp_cpu_offloaded(module: nn.Module) -> bool:
    """True when FSDP2 keeps this module's shards on the CPU (``CPUOffloadPolicy``)."""
    return any(fp.offload_to_cpu for fp in fsdp_params_by_id(module).values())


def clear_grads(module: nn.Module) -> None:
    """Drop a completed step's gradients (they are not moved)."""
    fsdp = fsdp_params_by_id(module)
    for p in module.parameters():
        p.grad = None
        fp = fsdp.get(id(p))
        if fp is not None:
            fp.unsharded_accumulated_grad = None


def _entry(key: str, t: torch.Tensor, fsdp_param: Any | None) -> MovedTensor:
    if fsdp_param is not None:
        return MovedTensor(key, t, fsdp_param._sharded_param_data, fsdp_param)
    if isinstance(t, DTensor):
        local = t._local_tensor
        if not local.is_contiguous():
            raise ValueError(f"{key}: a DTensor with a non-contiguous local tensor cannot move")
        return MovedTensor(key, t, local)
    return MovedTensor(key, t, t.detach())


def module_tensors(name: str, module: nn.Module, device: torch.device) -> list[MovedTensor]:
    """Parameters then buffers of ``module`` that live on ``device``, each once."""
    fsdp = fsdp_params_by_id(module)
    seen: set[int] = set()
    out: list[MovedTensor] = []
    for kind, items in (
        ("param", module.named_parameters(remove_duplicate=False)),
        ("buffer", module.named_buffers(remove_duplicate=False)),
    ):
        for qual, t in items:
            if t is None or id(t) in seen or tensor_device(t) != device:
                continue
            seen.add(id(t))
            out.append(_entry(f"{name}.{qual}", t, fsdp.get(id(t)) if kind == "param" else None))
    return out


def optimizer_tensors(
    name: str, optimizer: torch.optim.Optimizer, device: torch.device
) -> list[MovedTensor]:
    """The tensor values of ``optimizer.state`` that live on ``device``, each once."""
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    seen: set[int] = set()
    out: list[MovedTensor] = []
    for p, state in optimizer.state.items():
        for k, v in state.items():
            if not isinstance(v, torch.Tensor) or id(v) in seen or tensor_device(v) != device:
                continue
            seen.add(id(v))
            out.append(_entry(f"{name}.state[{index.get(id(p), '?')}].{k}", v, None))
    return out


def rebind_module(module: nn.Module, values: dict[int, torch.Tensor]) -> None:
    """Make ``module`` hold ``values[id(old)]`` in place of each old tensor.

    Goes through ``Module._apply`` so FSDP2 re-registers its sharded parameters and resets
    its padded-shard views itself; Parameter objects survive (``param.data`` assignment, or
    ``swap_tensors`` for DTensors), buffers are replaced.
    """

    def fn(t: torch.Tensor) -> torch.Tensor:
        return values.get(id(t), t)

    module._apply(fn)


def rebind_optimizer(optimizer: torch.optim.Optimizer, values: dict[int, torch.Tensor]) -> None:
    """Replace the optimizer's state values in place; the state dicts and param keys stay."""
    for state in optimizer.state.values():
        for k, v in list(state.items()):
            new = values.get(id(v)) if isinstance(v, torch.Tensor) else None
            if new is not None:
                state[k] = new
