"""Test support: run megatron-core 0.16 on a CPU-only torch build (gloo). Not used in production.

megatron-core assumes CUDA in helpers the model does not need. Measured on 0.16.1 with the local
(non-TransformerEngine) spec, these patches suffice for GPTModel forward/backward at TP/EP > 1,
the pipeline schedules (PP > 1: P2P over gloo), DDP, the distributed optimizer and
dist-checkpointing (sync and async):

1. ``torch.cuda.current_device()`` answers ``cpu``: megatron allocates scratch tensors (SP
   all-gather buffers, rotary ``inv_freq``, P2P receive buffers, DDP buckets) there.
2. The CUDA RNG tracker is megatron's inference tracker (``fork()`` is a no-op context); tests
   run without dropout, so no random stream is lost. The "CUDA" RNG state that activation
   recomputation (``tensor_parallel.checkpoint``) saves and restores is the CPU generator's.
3. ``torch.cuda.synchronize`` and streams are no-ops.
4. Modules that write ``device="cuda"`` literally see a ``torch`` whose tensor factories map it
   to the CPU and drop ``pin_memory=True`` (the rotary table's CP slice pins its index);
   ``Tensor.cuda()`` returns the tensor, ``Tensor.pin_memory()`` a copy.
5. ``Tensor.type()`` names a CPU float tensor ``torch.cuda.FloatTensor`` (the optimizers accept
   parameters by these type strings).
6. Collectives gloo lacks in the form the MoE all-to-all dispatcher uses (NCCL has them):
   ``all_to_all_single`` gets its split sizes as lists (the dispatcher passes tensors of
   counts); ``all_gather`` into a list of unequal sizes gathers zero-padded equal blocks and
   trims them; ``reduce_scatter`` of a list of unequal sizes all-reduces the concatenation and
   keeps this rank's part. Same results, gloo's own exchanges; nothing outside these calls.
Every patch is undone by :func:`uninstall`; :func:`installed` is a context manager.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_SAVED: dict[str, object] = {}
_CUDA_NAMES = (
    "current_device",
    "synchronize",
    "current_stream",
    "default_stream",
    "Stream",
    "stream",
)


class _NullStream:
    """Stands in for a CUDA stream: waits and records are no-ops on the CPU."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.wait_stream = self.synchronize = lambda *a, **k: None

    def record_event(self, event: object = None) -> _NullStream:
        return self  # an "event" whose synchronize() is a no-op


#: Modules that write ``device="cuda"`` literally; their ``torch`` becomes :class:`_CpuTorch`.
_CUDA_LITERAL_MODULES = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.utils",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.models.common.embeddings.rope_utils",
)


class _CpuTorch:
    """``torch`` for one module, with ``device="cuda"`` in tensor factories read as the CPU."""

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "zeros_like", "empty_like")

    def __getattr__(self, name: str) -> object:
        value = getattr(torch, name)
        if name not in self._FACTORIES:
            return value

        def factory(*args: object, **kwargs: object) -> torch.Tensor:
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            kwargs.pop("pin_memory", None)
            return value(*args, **kwargs)

        return factory


def _cuda_type_name(self: torch.Tensor, dtype: object = None, *args: object, **kwargs: object):
    """``Tensor.type()`` naming a CPU float tensor ``torch.cuda.FloatTensor`` (with an
    argument: the ordinary cast)."""
    original = _SAVED["Tensor.type"]
    if dtype is None and not args and not kwargs:
        name = original(self)
        return name if self.is_cuda else name.replace("torch.", "torch.cuda.", 1)
    return original(self, dtype, *args, **kwargs)


def _split_sizes(sizes: object) -> object:
    return [int(n) for n in sizes.tolist()] if hasattr(sizes, "tolist") else sizes


def _all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
    """``all_to_all_single`` with tensor split sizes turned into the lists gloo takes."""
    original = _SAVED["all_to_all_single"]
    return original(
        output, input, _split_sizes(output_split_sizes), _split_sizes(input_split_sizes), **kw
    )


def _all_gather(tensor_list, tensor, group=None, async_op=False):
    """``all_gather`` whose outputs may differ in their first dimension (gloo: equal only)."""
    original = _SAVED["all_gather"]
    if all(t.shape == tensor.shape for t in tensor_list):
        return original(tensor_list, tensor, group=group, async_op=async_op)
    longest = max(t.shape[0] for t in tensor_list)
    block = tensor.new_zeros((longest, *tensor.shape[1:]))
    block[: tensor.shape[0]] = tensor
    blocks = [torch.empty_like(block) for _ in tensor_list]
    original(blocks, block, group=group)
    for out, got in zip(tensor_list, blocks, strict=True):
        out.copy_(got[: out.shape[0]])
    return None


def _reduce_scatter(output, input_list, op=None, group=None, async_op=False):
    """``reduce_scatter`` (sum) of a list of tensors of any sizes: all-reduce, keep ours."""
    import torch.distributed as dist

    full = torch.cat([t.reshape(-1) for t in input_list])
    dist.all_reduce(full, group=group)
    rank = dist.get_rank(group)
    start = sum(t.numel() for t in input_list[:rank])
    output.copy_(full[start : start + output.numel()].view_as(output))
    return None


_COLLECTIVES = {
    "all_to_all_single": _all_to_all_single,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
}


def install() -> None:
    """Apply the patches (idempotent)."""
    if _SAVED:
        return
    from megatron.core.tensor_parallel import random as mrandom

    cuda = torch.cuda
    for name in _CUDA_NAMES:
        _SAVED[name] = getattr(cuda, name)
    cuda.current_device = lambda: torch.device("cpu")
    cuda.synchronize = lambda device=None: None
    cuda.current_stream = lambda device=None: _NullStream()
    cuda.default_stream = lambda device=None: _NullStream()
    cuda.Stream = _NullStream
    cuda.stream = lambda stream=None: contextlib.nullcontext()

    _SAVED["model_parallel_cuda_manual_seed"] = mrandom.model_parallel_cuda_manual_seed

    def manual_seed(seed: int, *args, **kwargs) -> None:
        torch.manual_seed(seed)
        mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)

    mrandom.model_parallel_cuda_manual_seed = manual_seed
    for name in ("_get_cuda_rng_state", "_set_cuda_rng_state"):
        _SAVED["random." + name] = getattr(mrandom, name)
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)

    import importlib

    for name in _CUDA_LITERAL_MODULES:
        module = importlib.import_module(name)
        _SAVED["torch@" + name] = module.torch
        module.torch = _CpuTorch()

    _SAVED["Tensor.type"] = torch.Tensor.type
    torch.Tensor.type = _cuda_type_name
    for name, adapter in _COLLECTIVES.items():
        _SAVED[name] = getattr(torch.distributed, name)
        setattr(torch.distributed, name, adapter)
    _SAVED["Tensor.cuda"] = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    _SAVED["Tensor.pin_memory"] = torch.Tensor.pin_memory
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self.clone()  # a copy, as pinning


def uninstall() -> None:
    """Undo :func:`install`."""
    if not _SAVED:
        return
    from megatron.core.tensor_parallel import random as mrandom

    for name in _CUDA_NAMES:
        setattr(torch.cuda, name, _SAVED[name])
    mrandom.model_parallel_cuda_manual_seed = _SAVED["model_parallel_cuda_manual_seed"]
    for name in ("_get_cuda_rng_state", "_set_cuda_rng_state"):
        setattr(mrandom, name, _SAVED["random." + name])
    import importlib

    for name in _CUDA_LITERAL_MODULES:
        importlib.import_module(name).torch = _SAVED["torch@" + name]
    torch.Tensor.type = _SAVED["Tensor.type"]
    for name in _COLLECTIVES:
        setattr(torch.distributed, name, _SAVED[name])
    torch.Tensor.cuda = _SAVED["Tensor.cuda"]
    torch.Tensor.pin_memory = _SAVED["Tensor.pin_memory"]
    mrandom.initialize_rng_tracker(force_reset=True)
    _SAVED.clear()


@contextlib.contextmanager
def installed() -> Iterator[None]:
    install()
    try:
        yield
    finally:
        uninstall()
