"""The on-disk format of ``disk-delta`` versions, shared by the writer and the puller.

::

    <disk dir>/latest                    the newest complete version number (temp + rename)
    <disk dir>/weight_v000000/index.json baseline: the --hf-checkpoint's tensors (no data file)
    <disk dir>/weight_vNNNNNN/
        index.json                       see below
        delta.safetensors                one 1-D uint8 tensor per written name:
                                         zstd(xor(new, base) | new)
    <disk dir>/pullers/<engine>.json     each puller's last result (version, path, error)

``index.json``: ``format``, ``version``, ``base_version`` (``None`` for a full state),
``kind`` (``baseline`` | ``full`` | ``delta``), ``checksum`` (the algorithm), ``file_checksum``
(of ``delta.safetensors``'s bytes), ``state_checksum``, ``published_bytes``, ``full_bytes`` and
``tensors``: for every tensor of the new state ``{dtype, shape, checksum, encoding}`` where
``encoding`` is ``xor``, ``overwrite`` (written in this version) or ``null`` (unchanged, taken
from the base). ``state_checksum`` is the checksum of the lines ``name dtype shape checksum``
of all tensors in name order: it pins the complete new state.

A directory becomes visible only complete: it is written under a temporary name, every file and
the directory are fsynced, then it is renamed into place, and only then is ``latest`` advanced.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Mapping
from pathlib import Path

import blake3
import numpy as np
import torch
import xxhash

FORMAT = "miles-disk-delta/1"
INDEX = "index.json"
DATA = "delta.safetensors"
LATEST = "latest"
CHECKSUMS = ("xxh3-128", "blake3", "adler32")
ENCODINGS = ("xor", "overwrite")


def version_dir_name(version: int) -> str:
    return f"weight_v{version:06d}"


def checksum_bytes(data: bytes | memoryview | np.ndarray, algorithm: str) -> str:
    """Hex digest of ``data`` with ``xxh3-128``, ``blake3`` or ``adler32``."""
    buf = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    if algorithm == "xxh3-128":
        return xxhash.xxh3_128_hexdigest(buf)
    if algorithm == "blake3":
        return blake3.blake3(buf).hexdigest()
    if algorithm == "adler32":
        return f"{zlib.adler32(buf) & 0xFFFFFFFF:08x}"
    raise ValueError(f"unknown checksum {algorithm!r}: choose from {', '.join(CHECKSUMS)}")


def tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's raw bytes as a uint8 array (CPU, contiguous; no copy when already so)."""
    flat = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
    return flat.numpy()


def checksum_tensor(tensor: torch.Tensor, algorithm: str) -> str:
    return checksum_bytes(tensor_bytes(tensor), algorithm)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return value


def state_checksum(tensors: Mapping[str, Mapping], algorithm: str) -> str:
    """Checksum of the whole state from each tensor's ``dtype``, ``shape`` and ``checksum``."""
    lines = [
        f"{name} {entry['dtype']} {list(entry['shape'])} {entry['checksum']}\n"
        for name, entry in sorted(tensors.items())
    ]
    return checksum_bytes("".join(lines).encode(), algorithm)


def xor_bytes(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.bitwise_xor(a, b)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """``path`` gets ``text`` or keeps its old content: temp file, fsync, rename, fsync dir."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def read_latest(disk_dir: Path) -> int | None:
    """The newest complete version in ``disk_dir`` (``None`` before the first publish)."""
    try:
        return int((disk_dir / LATEST).read_text().strip())
    except FileNotFoundError:
        return None


def read_index(version_dir: Path) -> dict:
    path = version_dir / INDEX
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise FileNotFoundError(f"{path}: missing (version not published?)") from error
    if index.get("format") != FORMAT:
        raise ValueError(f"{path}: format {index.get('format')!r}, expected {FORMAT!r}")
    return index
