"""``--update-weight-transfer-mode disk-delta``, the trainer's side: write changed tensors only.

The first publish records a baseline: the ``--hf-checkpoint``'s tensors (``weight_v000000``,
checksums only: the bytes are the checkpoint's). Every publish then writes ``weight_vNNNNNN``
with the tensors whose bytes changed since the previous version, each encoded ``xor`` (new bytes
XOR previous bytes: mostly zeros for a small update, so zstd shrinks it well) or ``overwrite``
(the new bytes), zstd-compressed, with checksums of every tensor and of the whole new state (see
:mod:`miles_sync.delta_format`). A writer that starts over an existing directory (a resumed
run) holds no previous state and writes a ``full`` version; ``full_every`` also writes one every
N versions, so a fresh puller never replays more than N deltas.

The writer keeps the last published state on the host (one copy of the weights in checkpoint
dtype). Each publish logs the published bytes against the full bytes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zstandard
from safetensors.torch import load_file, save_file

from miles_sync.delta_format import (
    CHECKSUMS,
    DATA,
    ENCODINGS,
    FORMAT,
    INDEX,
    LATEST,
    checksum_bytes,
    checksum_tensor,
    dtype_name,
    fsync_path,
    read_latest,
    state_checksum,
    tensor_bytes,
    version_dir_name,
    write_text_atomic,
    xor_bytes,
)
from miles_sync.errors import PublishError

logger = logging.getLogger(__name__)


def load_hf_state(hf_checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a HF checkpoint directory's ``*.safetensors`` (following its index)."""
    path = Path(hf_checkpoint)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"--hf-checkpoint {path}: no *.safetensors file")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(path / name), device="cpu"))
    return state


@dataclass
class DeltaWriterConfig:
    disk_dir: str
    hf_checkpoint: str | None
    encoding: str = "xor"
    checksum: str = "xxh3-128"
    full_every: int = 0  # 0: full versions only when the writer has no previous state
    zstd_level: int = 3

    def __post_init__(self) -> None:
        if self.encoding not in ENCODINGS:
            raise ValueError(f"--update-weight-delta-encoding must be one of {ENCODINGS}")
        if self.checksum not in CHECKSUMS:
            raise ValueError(f"--update-weight-delta-checksum must be one of {CHECKSUMS}")


@dataclass
class DeltaStats:
    version: int
    kind: str
    changed: int
    tensors: int
    published_bytes: int
    full_bytes: int
    seconds: float


class DeltaWriter:
    """Writes one version per :meth:`write` (called on one rank)."""

    def __init__(self, config: DeltaWriterConfig):
        self.config = config
        self.disk_dir = Path(config.disk_dir)
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        self._state: dict[str, torch.Tensor] | None = None
        self._entries: dict[str, dict] = {}
        self._version: int | None = None
        self._base: tuple | None = None  # (state, entries, version) the last version was made on
        self._compressor = zstandard.ZstdCompressor(level=config.zstd_level, write_checksum=True)

    @property
    def latest(self) -> int | None:
        return read_latest(self.disk_dir)

    def _record_baseline(self) -> None:
        """Version 0: the --hf-checkpoint's tensors, by checksum."""
        if not self.config.hf_checkpoint:
            raise PublishError("disk-delta needs --hf-checkpoint for its baseline")
        state = load_hf_state(self.config.hf_checkpoint)
        algo = self.config.checksum
        entries = {
            name: {
                "dtype": dtype_name(t.dtype),
                "shape": list(t.shape),
                "checksum": checksum_tensor(t, algo),
                "encoding": None,
            }
            for name, t in state.items()
        }
        index = {
            "format": FORMAT,
            "version": 0,
            "base_version": None,
            "kind": "baseline",
            "hf_checkpoint": str(Path(self.config.hf_checkpoint).resolve()),
            "checksum": algo,
            "file_checksum": None,
            "state_checksum": state_checksum(entries, algo),
            "published_bytes": 0,
            "full_bytes": sum(t.numel() * t.element_size() for t in state.values()),
            "tensors": entries,
        }
        self._commit_dir(0, index, None)
        self._state, self._entries, self._version = state, entries, 0

    def write(self, source: Iterable[tuple[str, torch.Tensor]], version: int) -> DeltaStats:
        """Write ``version`` from the source's tensors; returns what was written."""
        start = time.monotonic()
        latest = self.latest
        if version == self._version == latest and self._base is not None:
            # A retry of a publish whose version was written but not loaded: write it again
            # from the same base (the same trainer state gives the same bytes).
            self._state, self._entries, self._version = self._base
            latest = version - 1
        if self._state is None and latest is None:
            self._record_baseline()
            latest = 0
        if latest is not None and version <= latest:
            raise PublishError(
                f"disk-delta version {version} is not newer than {self.disk_dir}'s latest {latest}"
            )
        full = self._state is None or (
            self.config.full_every > 0 and version % self.config.full_every == 0
        )
        base = {} if self._state is None else self._state
        algo = self.config.checksum
        state = dict(base)
        entries = {name: dict(entry, encoding=None) for name, entry in self._entries.items()}
        blobs: dict[str, torch.Tensor] = {}
        published = 0
        for name, tensor in source:
            new = tensor.detach().to("cpu", copy=True).contiguous()
            new_bytes = tensor_bytes(new)
            old = base.get(name)
            same_layout = old is not None and old.dtype == new.dtype and old.shape == new.shape
            if not full and same_layout and np.array_equal(tensor_bytes(old), new_bytes):
                state[name] = old
                continue
            encoding = self.config.encoding if (same_layout and not full) else "overwrite"
            raw = xor_bytes(new_bytes, tensor_bytes(old)) if encoding == "xor" else new_bytes
            blob = self._compressor.compress(raw.tobytes())
            blobs[name] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
            published += len(blob)
            state[name] = new
            entries[name] = {
                "dtype": dtype_name(new.dtype),
                "shape": list(new.shape),
                "checksum": checksum_bytes(new_bytes, algo),
                "encoding": encoding,
            }
        if full:  # a full version holds every tensor, also those the source did not yield
            for name in state.keys() - blobs.keys():
                new_bytes = tensor_bytes(state[name])
                blob = self._compressor.compress(new_bytes.tobytes())
                blobs[name] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
                published += len(blob)
                entries[name] = dict(entries[name], encoding="overwrite")
        full_bytes = sum(t.numel() * t.element_size() for t in state.values())
        index = {
            "format": FORMAT,
            "version": version,
            "base_version": None if full else self._version,
            "kind": "full" if full else "delta",
            "checksum": algo,
            "file_checksum": None,
            "state_checksum": state_checksum(entries, algo),
            "published_bytes": published,
            "full_bytes": full_bytes,
            "tensors": entries,
        }
        self._commit_dir(version, index, blobs)
        self._base = (self._state, self._entries, self._version)
        self._state, self._entries, self._version = state, entries, version
        stats = DeltaStats(
            version,
            index["kind"],
            len(blobs),
            len(entries),
            published,
            full_bytes,
            time.monotonic() - start,
        )
        logger.info(
            "disk-delta %s v%d: %d/%d tensors changed, published %d bytes of %d (%.2f%%)",
            stats.kind,
            version,
            stats.changed,
            stats.tensors,
            published,
            full_bytes,
            100.0 * published / max(full_bytes, 1),
        )
        return stats

    def _commit_dir(self, version: int, index: dict, blobs: dict | None) -> None:
        """Write ``weight_vNNNNNN/`` atomically, then advance ``latest``."""
        final = self.disk_dir / version_dir_name(version)
        tmp = self.disk_dir / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        if blobs is not None:
            save_file(blobs, str(tmp / DATA))
            data = (tmp / DATA).read_bytes()
            index["file_checksum"] = checksum_bytes(data, index["checksum"])
            fsync_path(tmp / DATA)
        write_text_atomic(tmp / INDEX, json.dumps(index, indent=1))
        fsync_path(tmp)
        if final.exists():  # a leftover of a publish that died before advancing `latest`
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_path(self.disk_dir)
        write_text_atomic(self.disk_dir / LATEST, str(version))


def puller_key(engine_url: str) -> str:
    """File name of an engine's puller report: ``http://h:p`` -> ``h_p``."""
    bare = engine_url.split("://", 1)[-1].rstrip("/")
    return "".join(c if c.isalnum() or c in ".-" else "_" for c in bare)


def wait_for_pullers(
    disk_dir: str | Path, engine_urls: Sequence[str], version: int, timeout_s: float
) -> dict[str, str]:
    """Wait until every engine's puller holds ``version`` decoded; return url -> local path.

    Raises :class:`PublishError` with the puller's message when it refused the version (a corrupt
    or truncated delta), or after ``timeout_s`` naming the engines whose puller did not report.
    """
    reports = Path(disk_dir) / "pullers"
    deadline = time.monotonic() + timeout_s
    ready: dict[str, str] = {}
    while True:
        for url in engine_urls:
            if url in ready:
                continue
            try:
                report = json.loads((reports / f"{puller_key(url)}.json").read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                continue
            if report.get("version") is not None and report["version"] >= version:
                ready[url] = report["paths"][str(version)]
            elif report.get("error_version") == version and report.get("error"):
                raise PublishError(
                    f"the puller of engine {url} refused weight version {version}: "
                    f"{report['error']}; the engine stays on version {report.get('version')}"
                )
        if len(ready) == len(engine_urls):
            return ready
        if time.monotonic() > deadline:
            missing = [u for u in engine_urls if u not in ready]
            raise PublishError(
                f"no puller reported weight version {version} within {timeout_s:.0f}s for "
                f"{', '.join(missing)} (is `miles-sync pull` running beside each engine?)"
            )
        time.sleep(0.05)
