"""Flattened tensor buckets: many named tensors as one 1-D uint8 tensor plus metadata.

This is SGLang's ``flattened_bucket`` wire format (``/update_weights_from_tensor`` and
``/update_weights_from_distributed`` with ``load_format: "flattened_bucket"``):

* the bucket is the raw bytes of every tensor, concatenated in order;
* ``FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel)`` gives each
  tensor's byte range ``[start_idx, end_idx)`` with ``numel = end_idx - start_idx`` bytes
  (SGLang's ``numel`` counts the uint8 elements of the flattened slice, i.e. bytes);
* the layout is dense, exactly what SGLang's receiver rebuilds from names, dtypes and shapes
  (``FlattenedTensorBucket.empty``): each tensor starts where the previous one ends, and a
  tensor whose start is not a multiple of its dtype's item size is refused (``view(dtype)``
  would be illegal there). Several dtypes may share a bucket: the sender orders a bucket's
  tensors by item size, largest first (:func:`aligned_order`), so that every start is aligned
  without padding. A bucket's metadata, and so the names of its update call, are in that
  order.

SGLang unpickles payloads with an allowlist that names the class path
``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata``. A sender talking to real
SGLang wraps its metadata with :func:`to_sglang_metadata` and pickles the payload with
:func:`dumps_sglang_wire`, which writes that class path (sglang need not be installed);
the built-in engine accepts both class paths.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import io
import pickle
import sys
import threading
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch

from miles_sync.deferred import DeferredTensor

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


def aligned_order(named_tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """A bucket's tensors by item size, largest first (stable within an item size).

    Item sizes are powers of two, so every sum of larger item sizes' byte counts is a multiple
    of a smaller one: laid out densely in this order, every tensor's start is aligned.
    """
    return sorted(named_tensors, key=lambda item: -item[1].element_size())


def bucket_layout(
    named_specs: Iterable[tuple[str, torch.Size | tuple[int, ...], torch.dtype]],
) -> tuple[list[FlattenedTensorMetadata], int]:
    """Dense byte layout for ``(name, shape, dtype)`` specs, in their order: metadata and the
    bucket's total size. What SGLang's ``FlattenedTensorBucket.empty`` computes, with its
    refusals: a negative dimension, or a start that is not a multiple of the dtype's item size
    (order the specs with :func:`aligned_order` first)."""
    metadata: list[FlattenedTensorMetadata] = []
    offset = 0
    for name, shape, dtype in named_specs:
        shape = torch.Size(shape)
        if any(dim < 0 for dim in shape):
            raise ValueError(f"tensor {name!r} has a negative dimension: {tuple(shape)}")
        if offset % dtype.itemsize:
            raise ValueError(
                f"tensor {name!r}: byte offset {offset} is not aligned to {dtype} in a dense "
                "bucket (order a bucket's tensors by item size, largest first)"
            )
        nbytes = shape.numel() * dtype.itemsize
        metadata.append(
            FlattenedTensorMetadata(name, shape, dtype, offset, offset + nbytes, nbytes)
        )
        offset += nbytes
    return metadata, offset


def pack_bucket(
    named_tensors: list[tuple[str, torch.Tensor]],
) -> tuple[torch.Tensor, list[FlattenedTensorMetadata]]:
    """Pack tensors (any dtypes, same device; deferred tensors are filled in place) into one
    dense 1-D uint8 tensor and its metadata, in :func:`aligned_order` (the metadata's order,
    not necessarily ``named_tensors``')."""
    if not named_tensors:
        raise ValueError("cannot pack an empty bucket")
    devices = {tensor.device for _, tensor in named_tensors}
    if len(devices) != 1:
        raise ValueError(
            f"all tensors of a bucket must share a device, got {sorted(map(str, devices))}"
        )
    named_tensors = aligned_order(named_tensors)
    metadata, total = bucket_layout((name, t.shape, t.dtype) for name, t in named_tensors)
    flat = torch.empty(total, dtype=torch.uint8, device=devices.pop())
    for meta, (_, tensor) in zip(metadata, named_tensors):
        write_entry(flat, meta, tensor)
    return flat, metadata


def write_entry(flat: torch.Tensor, meta: FlattenedTensorMetadata, tensor, non_blocking=False):
    """Write ``tensor`` into its byte range of ``flat``: a copy, or a deferred tensor's fill of
    that range viewed in its dtype and shape (:mod:`miles_sync.deferred`)."""
    span = flat[meta.start_idx : meta.end_idx]
    if isinstance(tensor, DeferredTensor):  # also an empty one: a recorder may wrap its fill
        tensor.fill(span.view(meta.dtype).view(meta.shape))
    elif meta.numel:
        span.copy_(
            tensor.detach().contiguous().view(-1).view(torch.uint8), non_blocking=non_blocking
        )


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
    for group, _ in plan_buckets_marked(named_tensors, max_bytes):
        yield group


def plan_buckets_marked(
    named_tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """:func:`plan_buckets` as ``(group, is_last)``: the last group of the stream is marked, at
    the cost of reading one tensor past a full group (never a whole group ahead)."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    group: list[tuple[str, torch.Tensor]] = []
    full: list[tuple[str, torch.Tensor]] | None = None  # a closed group, waiting for a successor
    offset = 0
    for name, tensor in named_tensors:
        if full is not None:
            yield full, False
            full = None
        nbytes = tensor_nbytes(tensor)
        end = offset + nbytes  # dense: a group's packed size is the sum of its tensors' bytes
        if group and end > max_bytes:
            yield group, False
            group, offset = [], 0
            end = nbytes
        group.append((name, tensor))
        offset = end
        if offset >= max_bytes:
            full, group, offset = group, [], 0
    if full is not None:
        yield full, True
    if group:
        yield group, True


class SGLangFlattenedTensorMetadata(FlattenedTensorMetadata):
    """Our metadata under SGLang's class path ``sglang.srt.weight_sync.tensor_bucket.
    FlattenedTensorMetadata`` (what SGLang's unpickler allows), used when sglang itself is not
    installed here (see :func:`sglang_metadata_class`)."""


SGLangFlattenedTensorMetadata.__module__ = SGLANG_METADATA_MODULE
SGLangFlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
_WIRE_LOCK = threading.Lock()


@functools.cache
def _sglang_installed() -> bool:
    try:
        return importlib.util.find_spec("sglang") is not None
    except ValueError:  # a module named sglang without a spec
        return False


def sglang_metadata_class() -> type:
    """The class that pickles as SGLang's ``FlattenedTensorMetadata``: SGLang's own when sglang
    is installed here, else :class:`SGLangFlattenedTensorMetadata`."""
    if _sglang_installed():
        return importlib.import_module(SGLANG_METADATA_MODULE).FlattenedTensorMetadata
    return SGLangFlattenedTensorMetadata


@contextlib.contextmanager
def _sglang_path_resolvable() -> Iterator[None]:
    """While pickling without sglang installed: SGLang's module path (and its parent packages)
    resolve to stand-in modules, removed afterwards.

    The C pickler writes a class by its module path after importing that path and checking
    that it leads back to the class. The C pickler is what makes a bucket's pickling cheap: the
    pure-Python one, whose check can be skipped, cost ~0.1 ms per tensor (~30 ms per publish of
    a 1.7B model).
    """
    if _sglang_installed():
        yield
        return
    parts = SGLANG_METADATA_MODULE.split(".")
    names = [".".join(parts[: i + 1]) for i in range(len(parts))]
    with _WIRE_LOCK:
        added = [n for n in names if n not in sys.modules]
        for name in added:
            sys.modules[name] = types.ModuleType(name, "stand-in while pickling (miles_sync)")
        sys.modules[SGLANG_METADATA_MODULE].FlattenedTensorMetadata = SGLangFlattenedTensorMetadata
        try:
            yield
        finally:
            for name in reversed(added):
                del sys.modules[name]


def to_sglang_metadata(metadata: Iterable[FlattenedTensorMetadata]) -> list:
    """Metadata objects that pickle under SGLang's class path (:func:`sglang_metadata_class`)."""
    cls = sglang_metadata_class()
    return [
        cls(
            name=m.name,
            shape=torch.Size(m.shape),
            dtype=m.dtype,
            start_idx=m.start_idx,
            end_idx=m.end_idx,
            numel=m.numel,
        )
        for m in metadata
    ]


def dumps_sglang_wire(obj) -> bytes:
    """Pickle like SGLang's ``MultiprocessingSerializer`` (torch's ``ForkingPickler``: tensors
    travel as shared-memory / CUDA IPC handles). Metadata made by :func:`to_sglang_metadata`
    pickles under SGLang's class path. Base64 of this is one entry of
    ``serialized_named_tensors``. The sender must keep the tensors alive until the receiving
    call returns."""
    import torch.multiprocessing  # noqa: F401  (registers torch's reductions on ForkingPickler)

    buf = io.BytesIO()
    with _sglang_path_resolvable():
        ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()
