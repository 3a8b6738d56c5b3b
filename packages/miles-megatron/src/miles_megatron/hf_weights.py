"""HF checkpoints in and out of a (sharded) megatron model through the bridge.

Reading is lazy (``safetensors.safe_open``): each rank reads only the tensors its shard needs.
Writing produces ``model.safetensors`` (or shards with an index) plus the source
``config.json`` / tokenizer files, so the output loads with ``from_pretrained``.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from miles_megatron.bridge import Bridge, BridgeError, padded_vocab_size
from miles_megatron.sharding import iter_global_tensors, load_global_tensors

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class HFCheckpoint:
    """Lazy tensor access to an HF directory's ``*.safetensors`` files."""

    def __init__(self, hf_dir: str | Path) -> None:
        self.dir = Path(hf_dir)
        index = self.dir / INDEX_NAME
        if index.is_file():
            with index.open() as f:
                self.files = {k: self.dir / v for k, v in json.load(f)["weight_map"].items()}
        elif (self.dir / SINGLE_NAME).is_file():
            single = self.dir / SINGLE_NAME
            with safe_open(single, "pt") as f:
                self.files = {k: single for k in f.keys()}
        else:
            raise BridgeError(f"--hf-checkpoint {hf_dir}: no *.safetensors weights")
        self._open: dict[Path, Any] = {}

    def names(self) -> list[str]:
        return sorted(self.files)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def dtype(self) -> torch.dtype | None:
        """The dtype most of the weights are stored in (by element count), from the headers."""
        kinds = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16}
        kinds["F16"] = torch.float16
        counts: dict[torch.dtype, int] = {}
        for name, path in self.files.items():
            if path not in self._open:
                self._open[path] = safe_open(path, "pt")
            view = self._open[path].get_slice(name)
            dtype = kinds.get(view.get_dtype())
            if dtype is not None:
                counts[dtype] = counts.get(dtype, 0) + math.prod(view.get_shape())
        return max(counts, key=counts.__getitem__) if counts else None

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise BridgeError(f"HF checkpoint {self.dir} has no tensor {name}")
        path = self.files[name]
        if path not in self._open:
            self._open[path] = safe_open(path, "pt")
        return self._open[path].get_tensor(name)


def _tied_alias(name: str, margs: Mapping[str, Any]) -> str:
    if name == "output_layer.weight" and not margs.get("untie_embeddings_and_output_weights"):
        return "embedding.word_embeddings.weight"
    return name


def load_hf_into_model(
    model: torch.nn.Module,
    hf: HFCheckpoint | Mapping[str, torch.Tensor],
    bridge: Bridge,
    margs: Mapping[str, Any],
    tensor_parallel_size: int,
) -> int:
    """Fill this rank's parameters from an HF checkpoint; returns the count filled."""
    get = hf.get if isinstance(hf, HFCheckpoint) else hf.__getitem__
    padded = padded_vocab_size(margs, tensor_parallel_size)

    def full_tensor(name: str) -> torch.Tensor:
        return bridge.to_megatron(_tied_alias(name, margs), get, margs, padded)

    return load_global_tensors(
        model, full_tensor, margs.get("num_experts"), gated=bool(margs.get("swiglu"))
    )


def iter_hf_weights(
    model: torch.nn.Module,
    bridge: Bridge,
    margs: Mapping[str, Any],
    read: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF ``(name, tensor)`` of this PP stage, TP/EP-gathered (a collective on every rank).

    A tied output layer on the last stage is skipped (HF has only ``embed_tokens``).
    ``read``: each local parameter's values on the device (a sleeping model's
    :meth:`~miles_megatron.sleep_wake.SleepWake.read`); default the parameter itself.
    """
    tied = not margs.get("untie_embeddings_and_output_weights")
    tensors = (lambda _name, param: read(param.detach())) if read is not None else None
    for name, tensor in iter_global_tensors(
        model, margs.get("num_experts"), gated=bool(margs.get("swiglu")), tensors=tensors
    ):
        if tied and name == "output_layer.weight":
            continue
        yield from bridge.to_hf(name, tensor, margs)


def save_hf_checkpoint(
    out_dir: str | Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    source_dir: str | Path | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``tensors`` as ``model.safetensors`` plus the source dir's config/tokenizer files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in tensors:
        tensor = tensor.detach().to("cpu")
        state[name] = (tensor.to(dtype) if dtype else tensor).contiguous()
    save_file(state, str(out / SINGLE_NAME), metadata={"format": "pt"})
    if source_dir is not None:
        for path in Path(source_dir).iterdir():
            if (
                path.is_file()
                and not path.name.endswith(".safetensors")
                and path.name != INDEX_NAME
            ):
                shutil.copy2(path, out / path.name)
    return out
