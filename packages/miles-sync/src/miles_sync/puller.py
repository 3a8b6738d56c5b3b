"""The disk-delta puller (``miles-sync pull``): one beside each engine.

It watches ``--update-weight-disk-dir`` and, as soon as a new version appears (while the engine
still generates on the previous one), fetches it, verifies it and decodes it into a complete
local checkpoint ``--update-weight-local-checkpoint-dir/weight_vNNNNNN/model.safetensors``, which
the trainer's publish round then loads with ``/update_weights_from_disk``. It reports each
result in ``<disk dir>/pullers/<engine>.json``.

Verification: the checksum of the version's data file (a flipped or missing byte anywhere is
caught before decoding), zstd's own frame checksum, the checksum of every decoded tensor, and the
checksum of the whole new state. A version that fails any of them is refused: the local
checkpoint (and so the engine) stays on the previous version, and the report carries the error,
which the trainer raises.

A puller without local state (a fresh engine) starts from the newest ``full`` or ``baseline``
version at or below the latest, and applies only the deltas after it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zstandard
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file, save_file

from miles_sync.delta_format import (
    DATA,
    INDEX,
    LATEST,
    checksum_bytes,
    checksum_tensor,
    dtype_name,
    fsync_path,
    parse_dtype,
    read_index,
    read_latest,
    state_checksum,
    version_dir_name,
    write_text_atomic,
    xor_bytes,
)
from miles_sync.disk_delta import load_hf_state, puller_key
from miles_sync.errors import DeltaError

logger = logging.getLogger(__name__)

LOCAL_WEIGHTS = "model.safetensors"
#: Files of the HF checkpoint copied next to each local version (so it is a loadable checkpoint).
CHECKPOINT_SIDE_FILES = ("config.json", "generation_config.json")


@dataclass
class PullerConfig:
    disk_dir: str
    local_dir: str
    engine_url: str
    poll_interval_s: float = 0.5
    keep: int = 2  # local versions kept (the one loaded and the newest)


class Puller:
    """Brings a local checkpoint directory to the newest published version."""

    def __init__(self, config: PullerConfig):
        self.config = config
        self.disk_dir = Path(config.disk_dir)
        self.local_dir = Path(config.local_dir)
        self.local_dir.mkdir(parents=True, exist_ok=True)
        self.version: int | None = None
        self._state: dict[str, torch.Tensor] | None = None
        self._entries: dict[str, dict] = {}
        self._algo = "xxh3-128"
        self._side_files: Path | None = None
        self._last_error: tuple[int, str] | None = None

    # ---- state -------------------------------------------------------------------------
    def _load_local(self) -> None:
        """Resume from the newest local version (verified against its own index)."""
        local = read_latest(self.local_dir)
        if local is None:
            return
        where = self.local_dir / version_dir_name(local)
        try:
            index = read_index(where)
            state = load_file(str(where / LOCAL_WEIGHTS), device="cpu")
            self._verify_state(state, index, where)
        except (OSError, ValueError, SafetensorError, DeltaError) as error:
            logger.warning("ignoring local version %s: %s", where, error)
            return
        self._state, self._entries, self.version = state, index["tensors"], local
        self._algo = index["checksum"]

    def _read_index(self, version: int) -> dict:
        where = self.disk_dir / version_dir_name(version)
        try:
            return read_index(where)
        except (FileNotFoundError, ValueError, json.JSONDecodeError) as error:
            raise DeltaError(f"{where}: {error}") from error

    def _chain(self, latest: int) -> list[tuple[int, dict]]:
        """The versions to apply, oldest first, to go from what this puller holds to ``latest``:
        ``latest``'s base, its base, ... back to the version held, or to the newest full (or
        baseline) state, whichever comes first. Deltas older than that full state are never
        read."""
        chain = []
        version: int | None = latest
        while not (self._state is not None and version == self.version):
            if version is None:
                raise DeltaError(f"{self.disk_dir}: v{latest} has no full state in its history")
            index = self._read_index(version)
            chain.append((version, index))
            if index["kind"] in ("full", "baseline"):
                break
            version = index["base_version"]
        return chain[::-1]

    def _load_full(self, version: int, index: dict) -> None:
        where = self.disk_dir / version_dir_name(version)
        if index["kind"] == "baseline":
            try:
                state = load_hf_state(index["hf_checkpoint"])
            except (OSError, SafetensorError) as error:
                raise DeltaError(f"{where}: baseline checkpoint: {error}") from error
            self._side_files = Path(index["hf_checkpoint"])
        else:
            state = self._decode(where, index, base={})
        self._verify_state(state, index, where)
        self._state, self._entries, self.version = state, index["tensors"], version
        self._algo = index["checksum"]
        logger.info("puller: starting from the full state %s", where)

    # ---- decoding ----------------------------------------------------------------------
    def _decode(self, where: Path, index: dict, base: dict) -> dict[str, torch.Tensor]:
        """The new state of version ``where`` applied to ``base`` (``base`` is not modified)."""
        data_path = where / DATA
        try:
            data = data_path.read_bytes()
        except FileNotFoundError as error:
            raise DeltaError(f"{data_path}: missing") from error
        got = checksum_bytes(data, index["checksum"])
        if got != index["file_checksum"]:
            raise DeltaError(
                f"{data_path}: {index['checksum']} checksum {got} != published "
                f"{index['file_checksum']} (file corrupt or truncated)"
            )
        try:
            blobs = load_safetensors(data)
        except SafetensorError as error:
            raise DeltaError(f"{data_path}: not a safetensors file: {error}") from error
        decompressor = zstandard.ZstdDecompressor()
        state = dict(base)
        for name, entry in index["tensors"].items():
            encoding = entry["encoding"]
            if encoding is None:
                if name not in base:
                    raise DeltaError(f"{where}: {name} is unchanged but not in the base state")
                continue
            if name not in blobs:
                raise DeltaError(f"{data_path}: no data for {name}")
            dtype, shape = parse_dtype(entry["dtype"]), torch.Size(entry["shape"])
            try:
                raw = decompressor.decompress(blobs[name].numpy().tobytes())
            except zstandard.ZstdError as error:
                raise DeltaError(f"{data_path}: {name}: zstd: {error}") from error
            new_bytes = np.frombuffer(raw, dtype=np.uint8)
            if new_bytes.size != shape.numel() * dtype.itemsize:
                raise DeltaError(
                    f"{data_path}: {name}: {new_bytes.size} bytes decoded, "
                    f"{tuple(shape)} {dtype} needs {shape.numel() * dtype.itemsize}"
                )
            if encoding == "xor":
                old = base.get(name)
                if old is None or old.dtype != dtype or old.shape != shape:
                    raise DeltaError(f"{where}: {name} is xor-encoded but has no matching base")
                new_bytes = xor_bytes(
                    new_bytes, old.contiguous().view(-1).view(torch.uint8).numpy()
                )
            tensor = torch.frombuffer(bytearray(new_bytes.tobytes()), dtype=torch.uint8)
            tensor = tensor.view(dtype).reshape(shape)
            got = checksum_tensor(tensor, index["checksum"])
            if got != entry["checksum"]:
                raise DeltaError(
                    f"{where}: {name}: decoded checksum {got} != published {entry['checksum']}"
                )
            state[name] = tensor
        return state

    def _verify_state(self, state: dict, index: dict, where: Path) -> None:
        """Every tensor of ``state`` against ``index`` and the state checksum."""
        algo, entries = index["checksum"], index["tensors"]
        if set(state) != set(entries):
            missing, extra = set(entries) - set(state), set(state) - set(entries)
            raise DeltaError(
                f"{where}: state differs from its index: missing {sorted(missing)[:5]}, extra {sorted(extra)[:5]}"
            )
        computed = {}
        for name, tensor in state.items():
            computed[name] = {
                "dtype": dtype_name(tensor.dtype),
                "shape": list(tensor.shape),
                "checksum": checksum_tensor(tensor, algo),
            }
            if computed[name]["checksum"] != entries[name]["checksum"]:
                raise DeltaError(f"{where}: {name}: checksum mismatch")
        if state_checksum(computed, algo) != index["state_checksum"]:
            raise DeltaError(f"{where}: state checksum mismatch")

    def _apply(self, version: int, index: dict) -> None:
        where = self.disk_dir / version_dir_name(version)
        if index["kind"] == "delta" and index["base_version"] != self.version:
            raise DeltaError(
                f"{where}: a delta on v{index['base_version']}, but this puller holds "
                f"v{self.version}"
            )
        base = self._state if index["kind"] == "delta" else {}
        state = self._decode(where, index, base)
        algo = index["checksum"]
        entries = index["tensors"]
        if set(state) != set(entries):
            raise DeltaError(f"{where}: decoded tensors differ from the index's")
        if state_checksum(entries, algo) != index["state_checksum"]:
            raise DeltaError(f"{where}: state checksum mismatch")
        for name, entry in entries.items():
            if (
                entry["encoding"] is None
                and self._entries.get(name, {}).get("checksum") != entry["checksum"]
            ):
                raise DeltaError(
                    f"{where}: {name} is unchanged but its checksum differs from v{self.version}'s"
                )
        self._state, self._entries, self.version = state, entries, version
        self._algo = algo

    # ---- local checkpoint ------------------------------------------------------------
    def local_path(self, version: int) -> Path:
        return self.local_dir / version_dir_name(version)

    def _write_local(self) -> Path:
        final = self.local_path(self.version)
        if final.exists() and read_latest(self.local_dir) == self.version:
            return final
        tmp = self.local_dir / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file(self._state, str(tmp / LOCAL_WEIGHTS))
        fsync_path(tmp / LOCAL_WEIGHTS)
        index = {
            "format": "miles-disk-delta/1",
            "version": self.version,
            "kind": "local",
            "checksum": self._algo,
            "tensors": self._entries,
        }
        index["state_checksum"] = state_checksum(self._entries, index["checksum"])
        write_text_atomic(tmp / INDEX, json.dumps(index, indent=1))
        if self._side_files is not None:
            for side in CHECKPOINT_SIDE_FILES:
                if (self._side_files / side).exists():
                    shutil.copy2(self._side_files / side, tmp / side)
        fsync_path(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_path(self.local_dir)
        write_text_atomic(self.local_dir / LATEST, str(self.version))
        kept = sorted(self.local_dir.glob("weight_v*"))
        for old in kept[: max(0, len(kept) - self.config.keep)]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    # ---- the loop ---------------------------------------------------------------------
    def sync(self) -> int | None:
        """Bring the local checkpoint to the newest published version; report the result.

        Returns the local version. A version that cannot be verified raises
        :class:`DeltaError` (and is reported); the local checkpoint stays as it was.
        """
        latest = read_latest(self.disk_dir)
        if latest is None:
            return self.version
        failed = latest
        try:
            if self._state is None:
                self._load_local()
            for version, index in self._chain(latest):
                failed = version
                if index["kind"] == "delta":
                    self._apply(version, index)
                else:
                    self._load_full(version, index)
            if self._side_files is None:
                self._side_files = self._find_side_files()
            self._write_local()
        except DeltaError as error:
            self._report(error_version=failed, error=str(error))
            if self._last_error != (failed, str(error)):
                logger.error("puller: weight version %d refused: %s", failed, error)
                self._last_error = (failed, str(error))
            raise
        self._last_error = None
        self._report()
        return self.version

    def _find_side_files(self) -> Path | None:
        try:
            index = read_index(self.disk_dir / version_dir_name(0))
        except (FileNotFoundError, ValueError):
            return None
        return Path(index["hf_checkpoint"]) if index.get("hf_checkpoint") else None

    def _report(self, error_version: int | None = None, error: str | None = None) -> None:
        reports = self.disk_dir / "pullers"
        reports.mkdir(exist_ok=True)
        paths = {
            str(int(p.name.removeprefix("weight_v"))): str(p.resolve())
            for p in self.local_dir.glob("weight_v*")
        }
        report = {
            "engine_url": self.config.engine_url,
            "version": read_latest(self.local_dir),
            "paths": paths,
            "error_version": error_version,
            "error": error,
            "time": time.time(),
        }
        write_text_atomic(
            reports / f"{puller_key(self.config.engine_url)}.json", json.dumps(report)
        )

    def run(self, stop=None, once: bool = False) -> None:
        """Poll forever (or until ``stop.is_set()``); with ``once``, one :meth:`sync`."""
        while True:
            try:
                self.sync()
            except DeltaError:
                if once:
                    raise
            if once or (stop is not None and stop.is_set()):
                return
            time.sleep(self.config.poll_interval_s)
