"""The trainer's weights as the checkpoint names them: ``(hf_name, tensor)`` pairs.

This is what weight sync (miles-sync) and :func:`export_hf` consume; neither imports FSDP.
Parameters are gathered from their shards a group at a time (``gather_bytes`` of full tensors
at most, one tensor if it alone is larger), passed through the architecture's param
transforms, and cast to the dtype each tensor has in the original checkpoint (names unknown to
the checkpoint take ``default_dtype``). The output head is left out when it is tied to the input
embedding, as ``save_pretrained`` does. Collective: every rank iterates in lock step and every
rank receives the full tensors. With LoRA (``lora_scale`` set) a wrapped linear's base weight and
factors are gathered together and published merged, in the base checkpoint's names.

:meth:`WeightSource.deferred` (what an ``ipc`` publish iterates, every rank packing every bucket
in lock step) yields the same pairs with most tensors deferred (:mod:`miles_sync.deferred`):
a parameter sharded ``Shard(0)`` evenly over a 1-D mesh, which no param transform renames or
reshapes, is filled straight into the bucket that carries it: its local shard is cast to the
publish dtype (an elementwise cast commutes with the gather: the same bits) and all-gathered
into the bucket's bytes (one rank: one cast-copy into the bucket). Asleep, the shard is
``read`` onto the device when its bucket is packed, ``read_bytes`` of it at a time (an fp32
embedding is never on the device whole before its cast). Other tensors (uneven shards, HSDP,
transformed names, LoRA, CPU-offloaded parameters) are gathered as above.

``read`` (a sleeping trainer's :meth:`~miles_offload.device_mover.DeviceMover.read`) gives each
local shard's values (or a row range of them) on the device from wherever they sleep, so a
publish never wakes the model: only the tensors of one gather group are on the device at a
time. ``values`` replaces named parameters by other tensors of the same sharding (the EMA's
averages, read in place of the actor's values rather than swapped into them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from miles_sync.deferred import DeferredTensor
from torch import nn
from torch.distributed.tensor import DTensor, Shard

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
    read: Callable[..., torch.Tensor] | None = None  # (local tensor[, rows]) -> on device
    values: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> tensor read instead
    read_bytes: int = 64 << 20  # asleep, a deferred fill reads at most this much shard at once

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

    def deferred(self) -> Iterator[tuple[str, torch.Tensor | DeferredTensor]]:
        """The pairs of ``iter(self)``, in its order, with every tensor that can be filled
        straight into a bucket deferred (see the module docstring). Their fills are collective:
        every rank must fill the same ones in the same order (as identical packing on every
        rank does: miles-sync asks for them in ``ipc`` only)."""
        if self.lora_scale is not None:
            yield from self
            return
        for name, tensor in self._named_tensors():
            deferred = self._deferred(name, tensor)
            if deferred is not None:
                yield name, deferred
            else:
                yield from self._emit([(name, tensor)])

    def _deferred(self, name: str, tensor: torch.Tensor) -> DeferredTensor | None:
        """``tensor`` (a DTensor sharded evenly on dim 0 of a 1-D mesh, published under its own
        name and shape) as a deferred tensor in its publish dtype, else None."""
        if not isinstance(tensor, DTensor) or tuple(tensor.placements) != (Shard(0),):
            return None
        mesh = tensor.device_mesh
        if mesh.ndim != 1 or tensor.ndim == 0 or tensor.shape[0] % mesh.size():
            return None  # HSDP, or FSDP2's padded last shards: gathered as before
        local = tensor.to_local()
        if local.shape != (tensor.shape[0] // mesh.size(), *tensor.shape[1:]):
            return None
        if self.read is not None:  # asleep: the shard is read onto the device when filled
            if self.device is None:
                return None
            device = self.device
        elif self.device is not None and tensor.device != self.device:
            return None  # a CPU-offloaded parameter: gathered as before
        else:
            device = local.device
        probe = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        try:
            out = apply_param_transforms(self.adaptation, name, probe, self.config)
        except Exception:  # a transform that needs values: gathered as before
            return None
        if len(out) != 1 or out[0][0] != name or out[0][1] is not probe:
            return None
        dtype = self.tensor_dtypes.get(name, self.default_dtype)
        group = mesh.get_group() if mesh.size() > 1 else None
        read = self.read
        rows = local.shape[0]
        row_bytes = local.shape[1:].numel() * local.element_size()
        step = max(1, rows if read is None else min(rows, self.read_bytes // max(1, row_bytes)))

        def fill_rows(out: torch.Tensor) -> None:
            """``out`` (on ``device``) filled ``step`` shard rows at a time: asleep, only that
            many rows are on the device before their cast (an fp32 embedding is not read
            whole); every rank runs the same steps, so the gathers stay in lock step."""
            blocks = out.view(mesh.size(), rows, *out.shape[1:])
            for begin in range(0, rows, step):
                end = min(rows, begin + step)
                if read is None:
                    shard = local[begin:end]
                else:  # asleep: the storage is elsewhere (or freed), so ``read`` slices
                    shard = read(local, (begin, end))
                if group is None:
                    out[begin:end].copy_(shard)  # one rank: one cast-copy into the bucket
                    continue
                shard = shard.to(dtype).contiguous()
                whole = step == rows
                into = out
                if not whole:
                    into = out.new_empty((mesh.size(), end - begin, *out.shape[1:]))
                if into.numel():
                    dist.all_gather_into_tensor(
                        into.view(-1).view(torch.uint8),
                        shard.view(-1).view(torch.uint8),
                        group=group,
                    )
                if not whole:
                    blocks[:, begin:end].copy_(into)

        def fill(dest: torch.Tensor) -> None:
            if dest.device == device:
                fill_rows(dest)
            else:  # a bucket elsewhere: through a tensor here
                here = torch.empty(dest.shape, dtype=dtype, device=device)
                fill_rows(here)
                dest.copy_(here)

        return DeferredTensor(tensor.shape, dtype, device, fill)
