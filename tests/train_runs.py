"""Test support shared by the ``miles train`` end-to-end tests of both backends: the rollout
records of a ``--metrics-jsonl`` file and the tensors of a checkpoint directory."""

from __future__ import annotations

import json
from pathlib import Path

import torch

#: Train metrics that measure time or memory rather than the step.
NOT_THE_STEP = ("tokens_per_s", "peak_memory_gb")


def metric_records(path: Path) -> list[dict]:
    """The rollout records of a ``--metrics-jsonl`` file, their train metrics without
    :data:`NOT_THE_STEP`."""
    out = [r for r in map(json.loads, path.read_text().splitlines()) if "rollout_id" in r]
    for r in out:
        r["train"] = {k: v for k, v in r["train"].items() if k not in NOT_THE_STEP}
    return out


def dcp_tensors(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors of a torch.distributed.checkpoint directory (FSDP's ``model/``, megatron's
    torch_dist ``iter_*``), by flattened name: read straight from the checkpoint's metadata and
    files (no pickled objects are loaded; non-tensor entries are left out)."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(checkpoint_dir))
    metadata = reader.read_metadata()
    flat = {
        name: torch.empty(meta.size, dtype=meta.properties.dtype)
        for name, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    load(flat, storage_reader=reader, no_dist=True)
    return flat
