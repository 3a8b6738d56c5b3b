"""Flattened tensor buckets: many named tensors as one 1-D uint8 tensor plus metadata.

This is SGLang's ``flattened_bucket`` wire format (``/update_weights_from_tensor`` and
``/update_weights_from_distributed`` with ``load_format: "flattened_bucket"``):

* the bucket is the raw bytes of every tensor, concatenated in order;
* ``FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel)`` gives each
  tensor's byte range ``[start_idx, end_idx)`` with ``numel = end_idx - start_idx`` bytes
  (SGLang's ``numel`` counts the uint8 elements of the flattened slice, i.e. bytes);
* several dtypes may share a bucket; each ``start_idx`` is a multiple of its dtype's item
  size, so that ``bucket[start:end].view(dtype)`` is legal. Padding bytes between tensors
  are zero.

SGLang unpickles payloads with an allowlist that names the class path
``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata``. A sender talking to real
SGLang wraps its metadata with :func:`to_sglang_metadata` and pickles the payload with
:func:`dumps_sglang_wire`, which writes that class path (sglang need not be installed);
the built-in engine accepts both class paths.
"""

from __future__ import annotations

import copyreg
import io
import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch

SGLANG_METADATA_MODULE = "sglang.srt.weight_sync.tensor_bucket"


@dataclass
class FlattenedTensorMetadata:
    """Where one tensor lives inside a flattened uint8 bucket (byte offsets)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _align(offset: int, alignment: int) -> int:
    return (offset + alignment - 1) // alignment * alignment


def bucket_layout(
    named_specs: Iterable[tuple[str, torch.Size | tuple[int, ...], torch.dtype]],
) -> tuple[list[FlattenedTensorMetadata], int]:
    """Byte layout for ``(name, shape, dtype)`` specs: metadata and the bucket's total size.

    Each tensor starts at the next offset that is a multiple of ``dtype.itemsize``.
    """
    metadata: list[FlattenedTensorMetadata] = []
    offset = 0
    for name, shape, dtype in named_specs:
        shape = torch.Size(shape)
        if any(dim < 0 for dim in shape):
            raise ValueError(f"tensor {name!r} has a negative dimension: {tuple(shape)}")
        start = _align(offset, dtype.itemsize)
        nbytes = shape.numel() * dtype.itemsize
        metadata.append(FlattenedTensorMetadata(name, shape, dtype, start, start + nbytes, nbytes))
        offset = start + nbytes
    return metadata, offset


def pack_bucket(
    named_tensors: list[tuple[str, torch.Tensor]],
) -> tuple[torch.Tensor, list[FlattenedTensorMetadata]]:
    """Pack tensors (any dtypes, same device) into one 1-D uint8 tensor and its metadata."""
    if not named_tensors:
        raise ValueError("cannot pack an empty bucket")
    devices = {tensor.device for _, tensor in named_tensors}
    if len(devices) != 1:
        raise ValueError(
            f"all tensors of a bucket must share a device, got {sorted(map(str, devices))}"
        )
    metadata, total = bucket_layout((name, t.shape, t.dtype) for name, t in named_tensors)
    flat = torch.zeros(total, dtype=torch.uint8, device=devices.pop())
    for meta, (_, tensor) in zip(metadata, named_tensors):
        if meta.numel:
            flat[meta.start_idx : meta.end_idx].copy_(
                tensor.detach().contiguous().view(-1).view(torch.uint8)
            )
    return flat, metadata


def unpack_bucket(flat: torch.Tensor, metadata: Iterable) -> list[tuple[str, torch.Tensor]]:
    """Views of each tensor of a bucket (no copy). ``metadata`` items may be any object with
    the six metadata fields (ours, SGLang's or the SGLang-named alias)."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(
            f"a flattened bucket is a 1-D uint8 tensor, got {flat.dtype} {tuple(flat.shape)}"
        )
    out = []
    for meta in metadata:
        dtype, shape = meta.dtype, torch.Size(meta.shape)
        nbytes = shape.numel() * dtype.itemsize
        if (
            meta.end_idx - meta.start_idx != nbytes
            or meta.end_idx > flat.numel()
            or meta.start_idx < 0
        ):
            raise ValueError(
                f"bucket entry {meta.name!r}: bytes [{meta.start_idx}, {meta.end_idx}) do not hold "
                f"{tuple(shape)} {dtype} inside a bucket of {flat.numel()} bytes"
            )
        if meta.start_idx % dtype.itemsize:
            raise ValueError(
                f"bucket entry {meta.name!r}: offset {meta.start_idx} is not aligned to {dtype}"
            )
        out.append((meta.name, flat[meta.start_idx : meta.end_idx].view(dtype).view(shape)))
    return out


def plan_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Split a ``(name, tensor)`` stream into groups whose packed size is at most ``max_bytes``.

    Groups keep stream order. A tensor whose own size exceeds ``max_bytes`` travels alone in a
    group of one (the only case where a group is larger than the bound).
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    group: list[tuple[str, torch.Tensor]] = []
    offset = 0
    for name, tensor in named_tensors:
        nbytes = tensor_nbytes(tensor)
        end = _align(offset, tensor.element_size()) + nbytes
        if group and end > max_bytes:
            yield group
            group, offset = [], 0
            end = nbytes
        group.append((name, tensor))
        offset = end
        if offset >= max_bytes:
            yield group
            group, offset = [], 0
    if group:
        yield group


class SGLangFlattenedTensorMetadata(FlattenedTensorMetadata):
    """Our metadata, pickled by :func:`dumps_sglang_wire` under SGLang's class path
    ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`` (which need not be
    importable here: the pickler writes the name, it does not look it up)."""


def to_sglang_metadata(
    metadata: Iterable[FlattenedTensorMetadata],
) -> list[SGLangFlattenedTensorMetadata]:
    """Metadata objects that :func:`dumps_sglang_wire` pickles under SGLang's class path."""
    return [
        SGLangFlattenedTensorMetadata(
            m.name, torch.Size(m.shape), m.dtype, m.start_idx, m.end_idx, m.numel
        )
        for m in metadata
    ]


class _SGLangWirePickler(pickle._Pickler):
    """ForkingPickler's reductions (torch's tensor/storage sharing) in the pure-Python
    pickler, whose ``save_global`` we can steer: the alias class is written as the global
    ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`` without importing it."""

    def __init__(self, file, protocol: int = pickle.HIGHEST_PROTOCOL):
        super().__init__(file, protocol)
        self.dispatch_table = copyreg.dispatch_table.copy()
        self.dispatch_table.update(ForkingPickler._extra_reducers)

    def save_global(self, obj, name=None):
        if obj is SGLangFlattenedTensorMetadata:
            self.save(SGLANG_METADATA_MODULE)
            self.save("FlattenedTensorMetadata")
            self.write(pickle.STACK_GLOBAL)
            self.memoize(obj)
            return
        super().save_global(obj, name)


def dumps_sglang_wire(obj) -> bytes:
    """Pickle like SGLang's ``MultiprocessingSerializer`` (ForkingPickler: tensors travel as
    shared-memory / CUDA IPC handles), with bucket metadata under SGLang's class path.
    Base64 of this is one entry of ``serialized_named_tensors``. The sender must keep the
    tensors alive until the receiving call returns."""
    import torch.multiprocessing  # noqa: F401  (registers torch's reductions on ForkingPickler)

    buf = io.BytesIO()
    _SGLangWirePickler(buf).dump(obj)
    return buf.getvalue()
