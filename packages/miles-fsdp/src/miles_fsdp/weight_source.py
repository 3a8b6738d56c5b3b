"""The trainer's weights as the checkpoint names them: ``(hf_name, tensor)`` pairs.

This is what weight sync (miles-sync) and :func:`export_hf` consume; neither imports FSDP.
Parameters are gathered from their shards a group at a time (``gather_bytes`` of full tensors
at most, one tensor if it alone is larger), passed through the architecture's param
transforms, and cast to the dtype each tensor has in the original checkpoint (names unknown to
the checkpoint take ``default_dtype``). The output head is left out when it is tied to the input
embedding, as ``save_pretrained`` does. Collective: every rank iterates in lock step and every
rank receives the full tensors. With LoRA (``lora_scale`` set) a wrapped linear's base weight and
factors are gathered together and published merged, in the base checkpoint's names.

``read`` (a sleeping trainer's :meth:`~miles_offload.device_mover.DeviceMover.read`) gives each
local shard's values on the device from wherever they sleep, so a publish never wakes the
model: only the tensors of one gather group are on the device at a time. ``values`` replaces
named parameters by other tensors of the same sharding (the EMA's averages, read in place of
the actor's values rather than swapped into them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from miles_fsdp.adaptations import Adaptation, apply_param_transforms
from miles_fsdp.lora import continues_lora_module, merge_lora_tensors
from miles_fsdp.wrapping import embeddings_tied


@dataclass
class WeightSource:
    """Iterate a sharded model's weights in checkpoint form (see the module docstring)."""

    model: nn.Module
    config: Any
    adaptation: Adaptation
    tensor_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    default_dtype: torch.dtype = torch.bfloat16
    gather_bytes: int = 256 << 20
    device: torch.device | None = None
    lora_scale: float | None = None  # alpha / r of the actor's adapter under --use-lora
    read: Callable[[torch.Tensor], torch.Tensor] | None = None  # a local tensor -> on device
    values: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> tensor read instead

    def _named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        skip: set[str] = set()
        if embeddings_tied(self.model):
            head = self.model.get_output_embeddings()
            skip = {f"{n}.weight" for n, m in self.model.named_modules() if m is head}
        return [
            (n, self.values.get(n, t)) for n, t in self.model.state_dict().items() if n not in skip
        ]

    def _full(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.read is not None:
            if not isinstance(tensor, DTensor):
                return self.read(tensor)
            local = self.read(tensor.to_local())
            tensor = DTensor.from_local(
                local,
                tensor.device_mesh,
                tensor.placements,
                run_check=False,
                shape=tensor.shape,
                stride=tensor.stride(),
            )
        if isinstance(tensor, DTensor):
            if self.device is not None and tensor.device != self.device:
                tensor = tensor.to(self.device)
            return tensor.full_tensor()
        return tensor

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        group: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in self._named_tensors():
            group.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= self.gather_bytes and not (
                self.lora_scale is not None and continues_lora_module(name)
            ):
                yield from self._emit(group)
                group, size = [], 0
        if group:
            yield from self._emit(group)

    def _emit(self, group: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        gathered = [(name, self._full(tensor).detach()) for name, tensor in group]
        if self.lora_scale is not None:
            gathered = merge_lora_tensors(gathered, self.lora_scale)
        for name, full in gathered:
            for out_name, out in apply_param_transforms(self.adaptation, name, full, self.config):
                dtype = self.tensor_dtypes.get(out_name, self.default_dtype)
                yield out_name, out.to(dtype).contiguous()
