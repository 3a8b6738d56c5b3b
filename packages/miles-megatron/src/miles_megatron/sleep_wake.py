"""Sleep/wake of the megatron model and distributed optimizer (``--offload-train``).

Megatron's DDP keeps parameters and gradients in contiguous buffers that parameters,
``main_grad`` and the distributed optimizer's shards are *views* of, so nothing may be
re-allocated: the memory is released by shrinking each storage to zero bytes and grown back
on wake, which keeps every view valid (megatron-core's own ``offload_to_cpu`` /
``reload_from_cpu`` of its buffers does this for parameters and gradients).

* parameter buffers: copied to host memory (pinned on CUDA), storage freed, copied back;
* gradient buffers: freed, re-grown zeroed (a sleep happens between optimizer steps);
* optimizer state (Adam moments, fp32 master shards that are not views of a DDP buffer):
  copied to host memory, storage freed, copied back.

* frozen parameters (the LoRA base, outside the DDP buffers): copied to host memory on the
  first sleep only and *retained* there; every sleep frees their storage and every wake
  copies the retained copy back, so after the first cycle only what trains (adapters, their
  gradients and optimizer state) travels to the host.

``host_bytes_copied`` counts the bytes each sleep copied to the host (the last sleep's).
Both calls are idempotent. With ``--offload-train-target disk`` the miles-offload disk store is
not wired yet (an ArgumentError at init).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def _buffers(model) -> list:
    return list(model.buffers) + list(getattr(model, "expert_parallel_buffers", []))


def _optimizer_tensors(optimizer) -> Iterator[torch.Tensor]:
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            yield from group["params"]
        for state in inner.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    yield value


class SleepWake:
    """Releases and restores the device memory of a DDP model and its optimizer."""

    def __init__(self, model, optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        self.asleep = False
        self._host: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self._frozen_host: list[tuple[torch.Tensor, torch.Tensor, int]] | None = None
        self.host_bytes_copied = 0

    def _frozen_params(self, taken: set[int]) -> list[torch.Tensor]:
        out = []
        for param in self.model.parameters():
            storage = param.untyped_storage()
            if param.requires_grad or storage.data_ptr() in taken or storage.size() == 0:
                continue
            taken.add(storage.data_ptr())
            out.append(param)
        return out

    def _sync(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def sleep(self) -> None:
        if self.asleep:
            return
        self._sync()
        self.host_bytes_copied = 0
        buffer_storages = set()
        for buffer in _buffers(self.model):
            for t in (buffer.param_data, buffer.grad_data):
                if t is not None:
                    buffer_storages.add(t.untyped_storage().data_ptr())
            if buffer.param_data is not None:
                self.host_bytes_copied += buffer.param_data.untyped_storage().size()
            buffer.offload_to_cpu(move_params=True, move_grads=True)
        seen = set(buffer_storages)
        self._sleep_frozen(seen)
        self._host = []
        for t in _optimizer_tensors(self.optimizer):
            storage = t.untyped_storage()
            if storage.data_ptr() in seen or storage.size() == 0:
                continue  # a view of a DDP buffer (already handled) or already moved
            seen.add(storage.data_ptr())
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            host.copy_(t)
            self.host_bytes_copied += storage.size()
            self._host.append((t, host, storage.size()))
            storage.resize_(0)
        self._sync()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.asleep = True

    def _sleep_frozen(self, seen: set[int]) -> None:
        """Free the frozen parameters; the first sleep keeps a host copy for all later wakes."""
        if self._frozen_host is None:
            self._frozen_host = []
            for param in self._frozen_params(seen):
                host = torch.empty(param.shape, dtype=param.dtype, pin_memory=param.is_cuda)
                host.copy_(param.detach())
                nbytes = param.untyped_storage().size()
                self.host_bytes_copied += nbytes
                self._frozen_host.append((param, host, nbytes))
        for param, _, _ in self._frozen_host:
            seen.add(param.untyped_storage().data_ptr())
            param.untyped_storage().resize_(0)

    def wake_up(self) -> None:
        if not self.asleep:
            return
        for param, host, nbytes in self._frozen_host or []:
            param.untyped_storage().resize_(nbytes)
            param.detach().copy_(host)
        for buffer in _buffers(self.model):
            buffer.reload_from_cpu(move_params=True, move_grads=True)
        for t, host, nbytes in self._host:
            t.untyped_storage().resize_(nbytes)
            t.copy_(host)
        self._host = []
        self._sync()
        self.asleep = False

    def device_bytes(self) -> int:
        """Bytes currently held by the buffers', parameters' and optimizer tensors' storages."""
        total, seen = 0, set()
        tensors = [b.param_data for b in _buffers(self.model)] + [
            b.grad_data for b in _buffers(self.model)
        ]
        params = list(self.model.parameters())
        for t in [*tensors, *params, *_optimizer_tensors(self.optimizer)]:
            if t is None:
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if storage.data_ptr() and key not in seen:
                seen.add(key)
                total += storage.size()
        return total
