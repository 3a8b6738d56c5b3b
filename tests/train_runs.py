"""Test support shared by the ``miles train`` end-to-end tests of both backends: the rollout
records of a ``--metrics-jsonl`` file, the tensors of a checkpoint directory, and the
``--update-weight-verify`` lines of a job's output."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

#: Train metrics that measure time or memory rather than the step.
NOT_THE_STEP = ("tokens_per_s", "peak_memory_gb")


def metric_records(path: Path) -> list[dict]:
    """The rollout records of a ``--metrics-jsonl`` file, their train metrics without
    :data:`NOT_THE_STEP` (the actor's and the critic's, ``critic/<name>``)."""
    out = [r for r in map(json.loads, path.read_text().splitlines()) if "rollout" in r]
    for r in out:
        r["train"] = {
            k: v for k, v in r["train"].items() if k.removeprefix("critic/") not in NOT_THE_STEP
        }
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


#: Rank 0's line after each publish checked with ``--update-weight-verify`` (miles_sync.readback).
VERIFIED = re.compile(
    r"weight version (\d+) verified: (\d+) tensors on (\d+) engines .*?\(state ([0-9a-f]+)\)"
)


def assert_publishes_verified(output: str, versions: list[int], engines: int) -> str:
    """A ``miles train ... --update-weight-verify`` job's output shows every publish of
    ``versions`` read back from all ``engines`` engines, bit for bit, the same tensors each
    time (the job fails on the first difference; this shows the check ran). Returns the last
    publish's state digest (``miles_sync.readback.tensors_digest`` of what it sent), to compare
    with the checkpoint the job saved."""
    seen = {int(v): (int(t), int(e), state) for v, t, e, state in VERIFIED.findall(output)}
    assert sorted(seen) == versions, f"verified versions {sorted(seen)}, published {versions}"
    assert {e for _, e, _ in seen.values()} == {engines}, seen
    assert len({t for t, _, _ in seen.values()}) == 1 and min(t for t, _, _ in seen.values()) > 0
    return seen[versions[-1]][2]
