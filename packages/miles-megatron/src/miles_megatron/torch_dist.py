"""megatron-core ``dist_checkpointing`` in the ``torch_dist`` format, model weights only.

The model's ``sharded_state_dict()`` describes every tensor by its global shape and this rank's
offset, so a checkpoint written at one TP/PP/EP layout loads at any other. ``save_model_weights``
writes ``*.distcp`` files into one directory (the caller's ``iter_XXXXXXX/``, see
:mod:`miles_core.checkpoint_layout`); ``load_model_weights`` fills the current model from one.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint import FileSystemReader

from miles_megatron.sharding import unwrap


def save_strategy(synchronous: bool):
    # thread_count=1 writes from the calling thread: the gloo/CPU path has no async copy engine
    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1 if synchronous else 2)


def base_sharded_state_dict(module: torch.nn.Module) -> dict:
    """The model's sharded state dict without LoRA factors (``*.adapter.lora_A|B.*``): the
    weights of a base checkpoint (adapters have their own, :mod:`miles_megatron.lora.checkpoint`)."""
    state = module.sharded_state_dict(prefix="")
    return {k: v for k, v in state.items() if ".adapter.lora_" not in k}


def save_model_weights(
    model: torch.nn.Module, directory: str | Path, synchronous: bool = True
) -> None:
    """Write this model's weights (a collective over every rank) into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {"model": base_sharded_state_dict(unwrap(model))}
    dist_checkpointing.save(state, str(directory), sharded_strategy=save_strategy(synchronous))


def saved_weights_dtype(directory: str | Path) -> torch.dtype | None:
    """The dtype most of the model weights in a ``torch_dist`` directory are stored in (by
    element count; the optimizer's entries are not weights), from its metadata alone; None when
    it holds no floating-point weight."""

    metadata = FileSystemReader(str(directory)).read_metadata()
    counts: Counter = Counter()
    for key, entry in metadata.state_dict_metadata.items():
        properties = getattr(entry, "properties", None)
        if properties is None or key.startswith("optimizer."):
            continue
        if properties.dtype.is_floating_point:
            counts[properties.dtype] += math.prod(entry.size)
    return max(counts, key=counts.__getitem__) if counts else None


def load_model_weights(model: torch.nn.Module, directory: str | Path) -> None:
    """Fill this model's weights from a ``torch_dist`` directory written at any layout."""
    module = unwrap(model)
    state = {"model": base_sharded_state_dict(module)}
    loaded = dist_checkpointing.load(state, str(directory))
    missing, unexpected = module.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state") and ".adapter.lora_" not in k]
    if missing:
        raise RuntimeError(f"torch_dist checkpoint {directory} lacks {missing[:5]}")
