"""Load a HF directory as-is into an FSDP2-sharded model.

Order of work (every rank, in lock step):

1. rank 0 validates the directory (:func:`validate_hf_dir`) and broadcasts the verdict, so a bad
   directory fails on every rank with the same one-line error before anything is allocated;
2. every rank builds the model on the ``meta`` device (``from_config``), applies the
   architecture's model/instance/packing patches and shards it (``fully_shard``);
3. rank 0 alone reads the weights with ``AutoModelForCausalLM.from_pretrained``, applies the
   post-load fixups and keeps the full state (parameters and *all* buffers, persistent or not);
4. the sharded model is materialised (``to_empty``) and filled: parameters through
   ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``, buffers by
   broadcast from rank 0.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from miles_core import varlen_attention
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


class HFCheckpointError(ValueError):
    """The ``--hf-checkpoint`` directory cannot be loaded; the message names the file."""


@dataclass(frozen=True)
class HFCheckpointInfo:
    """What validation learned about a HF directory.

    ``tensor_dtypes`` maps every checkpoint tensor name to its dtype as stored on disk; published
    and exported weights are cast back to these dtypes.
    """

    path: Path
    model_type: str
    tensor_dtypes: dict[str, torch.dtype]


def _shard_files(path: Path) -> dict[str, list[str] | None]:
    """Map each safetensors file of ``path`` to the tensor names the index promises in it."""
    index = path / SAFETENSORS_INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise HFCheckpointError(f"{index}: not a safetensors index ({exc})") from exc
        files: dict[str, list[str] | None] = {}
        for tensor_name, file_name in weight_map.items():
            files.setdefault(file_name, []).append(tensor_name)
        return files
    if (path / SAFETENSORS_SINGLE).exists():
        return {SAFETENSORS_SINGLE: None}
    raise HFCheckpointError(
        f"{path}: no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX} (only safetensors weights load)"
    )


def _read_shard_dtypes(file: Path, promised: list[str] | None) -> dict[str, torch.dtype]:
    if not file.exists():
        raise HFCheckpointError(
            f"{file}: safetensors shard listed in {SAFETENSORS_INDEX} is missing"
        )
    size = file.stat().st_size
    try:
        dtypes: dict[str, torch.dtype] = {}
        end = 0
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                sliced = handle.get_slice(name)
                dtypes[name] = getattr(torch, _SAFETENSORS_DTYPES[sliced.get_dtype()])
        with open(file, "rb") as raw:
            header_len = int.from_bytes(raw.read(8), "little")
            header = json.loads(raw.read(header_len))
        for name, entry in header.items():
            if name != "__metadata__":
                end = max(end, entry["data_offsets"][1])
    except HFCheckpointError:
        raise
    except Exception as exc:  # safetensors raises its own error types for malformed headers
        raise HFCheckpointError(f"{file}: corrupt safetensors file ({exc})") from exc
    if 8 + header_len + end > size:
        raise HFCheckpointError(
            f"{file}: truncated safetensors file ({size} bytes, header needs {8 + header_len + end})"
        )
    if promised is not None:
        missing = sorted(set(promised) - set(dtypes))
        if missing:
            raise HFCheckpointError(
                f"{file}: lacks {len(missing)} tensor(s) listed in {SAFETENSORS_INDEX}, e.g. {missing[0]}"
            )
    return dtypes


_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def load_config(path: Path) -> Any:
    """Read ``config.json`` through ``AutoConfig`` and check it maps to a causal LM class."""
    config_file = path / "config.json"
    if not config_file.exists():
        raise HFCheckpointError(f"{config_file}: missing (--hf-checkpoint needs a HF model dir)")
    try:
        json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise HFCheckpointError(f"{config_file}: invalid JSON ({exc})") from exc
    try:
        config = AutoConfig.from_pretrained(str(path))
    except Exception as exc:  # transformers raises ValueError/KeyError for unknown model types
        raise HFCheckpointError(
            f"{config_file}: transformers cannot map this config ({str(exc).splitlines()[0]})"
        ) from exc
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise HFCheckpointError(
            f"{config_file}: model_type {config.model_type!r} has no causal-LM class in transformers"
        )
    return config


def validate_hf_dir(path: str | os.PathLike) -> HFCheckpointInfo:
    """Check a HF directory completely before any model is built.

    Raises :class:`HFCheckpointError` naming the offending file for: a missing directory or
    ``config.json``; a config transformers cannot map to a causal LM; a missing, truncated or
    corrupt safetensors shard (or one lacking tensors its index promises); a tokenizer that
    ``AutoTokenizer`` cannot load.
    """
    path = Path(path)
    if not path.is_dir():
        raise HFCheckpointError(f"{path}: --hf-checkpoint is not a directory")
    config = load_config(path)
    dtypes: dict[str, torch.dtype] = {}
    for file_name, promised in _shard_files(path).items():
        dtypes.update(_read_shard_dtypes(path / file_name, promised))
    try:
        AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        present = sorted(p.name for p in path.glob("tokenizer*")) or ["no tokenizer* files"]
        raise HFCheckpointError(
            f"{path / present[0]}: tokenizer failed to load ({str(exc).splitlines()[0]})"
        ) from exc
    return HFCheckpointInfo(path=path, model_type=config.model_type, tensor_dtypes=dtypes)


def validate_on_rank0(path: str | os.PathLike) -> HFCheckpointInfo:
    """Validate on rank 0 and share the verdict: every rank raises the same error or returns."""
    if not dist.is_initialized():
        return validate_hf_dir(path)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = validate_hf_dir(path)
        except HFCheckpointError as exc:
            box[0] = str(exc)
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise HFCheckpointError(box[0])
    return box[0]


def build_meta_model(config: Any, dtype: torch.dtype, attn_implementation: str) -> nn.Module:
    """The model skeleton on the meta device (no memory), parameters in ``dtype``."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation
        )


def read_full_state(
    path: Path, config: Any, dtype: torch.dtype, attn_implementation: str, fixups: list
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Rank 0: ``from_pretrained`` on the CPU, run post-load fixups, return (state, buffers).

    ``state`` is the model's state dict in ``dtype``; ``buffers`` holds every buffer, including
    non-persistent ones (rotary ``inv_freq``) that a state dict leaves out.
    """
    model = AutoModelForCausalLM.from_pretrained(
        str(path), config=config, dtype=dtype, attn_implementation=attn_implementation
    )
    for fixup in fixups:
        fixup(model, config)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    return state, buffers


def fill_sharded_model(
    model: nn.Module,
    device: torch.device,
    full_state: dict[str, torch.Tensor] | None,
    full_buffers: dict[str, torch.Tensor] | None,
    buffer_device: torch.device | None = None,
) -> None:
    """Materialise a sharded meta model, parameters on ``device`` and buffers on
    ``buffer_device`` (default: ``device``), and fill it from rank 0's full state.

    ``full_state``/``full_buffers`` are given on rank 0 and ``None`` elsewhere.
    """
    model.to_empty(device=device)
    buffer_device = device if buffer_device is None else buffer_device
    for module in model.modules():
        for key, buffer in module._buffers.items():
            if buffer is not None and buffer.device != buffer_device:
                module._buffers[key] = torch.empty_like(buffer, device=buffer_device)
    is_src = not dist.is_initialized() or dist.get_rank() == 0
    set_model_state_dict(
        model,
        full_state if is_src else {},
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True),
    )
    for name, buffer in sorted(model.named_buffers()):
        if is_src:
            buffer.copy_(full_buffers[name].to(buffer.dtype))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(buffer, src=0)


ATTN_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3", "varlen", "sdpa", "eager")


def resolve_attn_implementation(requested: str | None) -> str:
    """``--attn-implementation`` as the name the HF model is built with: explicit values pass
    through (``varlen`` becomes :data:`miles_fsdp.varlen_hf.HF_NAME`, registered now); unset means
    flash_attention_2 when ``flash_attn`` imports on a GPU, else varlen where torch ships its
    varlen kernel for this GPU, else sdpa (with a one-line notice)."""
    if requested:
        if requested not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"--attn-implementation must be one of {ATTN_IMPLEMENTATIONS}, got {requested!r}"
            )
        return _varlen_hf_name() if requested == "varlen" else requested
    if torch.cuda.is_available():
        try:
            import flash_attn  # noqa: F401  (optional: flash-attn, probed)

            return "flash_attention_2"
        except ImportError:
            pass
        if varlen_attention.kernel_available("cuda"):
            _say("miles-fsdp: flash_attn unavailable, using torch's varlen flash attention")
            return _varlen_hf_name()
    _say("miles-fsdp: flash_attn unavailable, using --attn-implementation sdpa")
    return "sdpa"


def _varlen_hf_name() -> str:
    from miles_fsdp.varlen_hf import HF_NAME  # registers it with transformers

    return HF_NAME


def _say(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def finish_lazy_init(model: nn.Module) -> None:
    """Run FSDP2's lazy initialisation now (at load time) instead of in the first forward."""
    state = getattr(model, "_get_fsdp_state", None)
    if state is not None:
        state()._lazy_init()
