"""Checks of a weight update against the model, run before any byte of it is loaded.

Every update (tensor, bucket, distributed, disk) is planned before it is loaded: each name must be a
parameter or buffer of the model (or a per-expert slice of a batched expert parameter), its
shape must equal the target's, and its dtype may differ only within a kind: float to float
is cast (SGLang's loaders cast too: fp32 masters published into a bf16 engine are the
design), while a change between float, int, bool and complex is refused. A failed check is a
:class:`WeightUpdateError` naming the tensor, and nothing has been written: the model and the
weight version stay as they were.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch
from miles_sync.buckets import FlattenedTensorMetadata

#: Most elements one tensor of an update may claim (a larger spec is refused before allocation).
MAX_TENSOR_NUMEL = 1 << 40


class WeightUpdateError(ValueError):
    """A weight update does not fit the model or is malformed (answered with 400)."""


def dtype_kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "float"
    return "int"


def check_fits(name: str, shape: Sequence[int], dtype: torch.dtype, target: torch.Tensor) -> None:
    """``(shape, dtype)`` may be loaded into ``target`` (the tensor named ``name``)."""
    if tuple(shape) != tuple(target.shape):
        raise WeightUpdateError(f"{name}: shape {tuple(shape)} != model's {tuple(target.shape)}")
    if dtype_kind(dtype) != dtype_kind(target.dtype):
        raise WeightUpdateError(
            f"{name}: dtype {str(dtype).removeprefix('torch.')} cannot be loaded into the "
            f"model's {str(target.dtype).removeprefix('torch.')} (a {dtype_kind(dtype)} -> "
            f"{dtype_kind(target.dtype)} change; only casts within a kind are allowed)"
        )


def plan_load(
    named: Iterable[tuple[str, torch.Tensor]], resolve: Callable[[str], torch.Tensor | None]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(target, tensor), ...]`` for every named tensor, all checked before any is loaded."""
    plan = []
    for name, tensor in named:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise WeightUpdateError(
                f"an update entry must be (str name, tensor), got "
                f"({type(name).__name__}, {type(tensor).__name__})"
            )
        target = resolve(name)
        if target is None:
            raise WeightUpdateError(f"model has no parameter or buffer named {name!r}")
        check_fits(name, tensor.shape, tensor.dtype, target)
        plan.append((target, tensor))
    return plan


def parse_dtype(value, field: str) -> torch.dtype:
    """``"bfloat16"`` / ``"torch.bfloat16"`` -> ``torch.bfloat16``; anything else is refused."""
    dtype = (
        getattr(torch, str(value).removeprefix("torch."), None) if isinstance(value, str) else None
    )
    if not isinstance(dtype, torch.dtype):
        raise WeightUpdateError(f"{field}: unknown dtype {value!r}")
    return dtype


def parse_shape(value, field: str) -> list[int]:
    if not isinstance(value, (list, tuple, torch.Size)) or not all(
        type(d) is int and d >= 0 for d in value
    ):
        raise WeightUpdateError(
            f"{field}: a shape must be a list of non-negative ints, got {value!r}"
        )
    if math.prod(value) > MAX_TENSOR_NUMEL:
        raise WeightUpdateError(f"{field}: shape {list(value)} is too large")
    return list(value)


def parse_distributed_spec(names, dtypes, shapes) -> tuple[list[str], list[torch.dtype], list]:
    """The ``names``/``dtypes``/``shapes`` of ``/update_weights_from_distributed``, checked for
    form before anything is allocated or received. Whether they fit the model is checked after
    the broadcast was received, before any byte is loaded (:func:`plan_load`): the trainer's
    broadcast must be drained either way, or it would wait for the group's timeout."""
    for field, value in (("names", names), ("dtypes", dtypes), ("shapes", shapes)):
        if not isinstance(value, list):
            raise WeightUpdateError(f"{field} must be a list, got {type(value).__name__}")
    if not (len(names) == len(dtypes) == len(shapes)):
        raise WeightUpdateError(
            f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}"
        )
    torch_dtypes, checked_shapes = [], []
    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes)):
        if not isinstance(name, str):
            raise WeightUpdateError(f"names[{i}] must be a string, got {name!r}")
        torch_dtypes.append(parse_dtype(dtype, f"dtypes[{i}] ({name})"))
        checked_shapes.append(parse_shape(shape, f"shapes[{i}] ({name})"))
    return names, torch_dtypes, checked_shapes


#: The fields of a bucket's metadata objects (ours and SGLang's ``FlattenedTensorMetadata``).
METADATA_FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")


def check_metadata(i: int, meta, bucket_bytes: int):
    """``metadata[i]`` of a bucket of ``bucket_bytes`` bytes, checked field by field: a fresh
    :class:`~miles_sync.buckets.FlattenedTensorMetadata` of its values (nothing else the
    decoded object carries is kept)."""
    if not isinstance(meta, FlattenedTensorMetadata):
        raise WeightUpdateError(f"metadata[{i}] is a {type(meta).__name__}, not bucket metadata")
    fields = getattr(meta, "__dict__", None)
    if not isinstance(fields, dict):
        raise WeightUpdateError(f"metadata[{i}] has no fields")
    missing = [f for f in METADATA_FIELDS if f not in fields]
    extra = sorted(str(k) for k in fields.keys() - set(METADATA_FIELDS))
    if missing or extra:
        raise WeightUpdateError(
            f"metadata[{i}]: "
            + "; ".join(
                ([f"missing field(s) {missing}"] if missing else [])
                + ([f"unknown field(s) {extra}"] if extra else [])
            )
        )
    name = fields["name"]
    if not isinstance(name, str):
        raise WeightUpdateError(f"metadata[{i}].name must be a string, got {name!r}"[:200])
    where = f"metadata[{i}] ({name!r})"
    dtype = fields["dtype"]
    if not isinstance(dtype, torch.dtype):
        raise WeightUpdateError(f"{where}.dtype must be a torch dtype, got {dtype!r}"[:200])
    shape = parse_shape(fields["shape"], f"{where}.shape")
    for field in ("start_idx", "end_idx", "numel"):
        if type(fields[field]) is not int:
            raise WeightUpdateError(f"{where}.{field} must be an int, got {fields[field]!r}"[:200])
    start, end, nbytes = fields["start_idx"], fields["end_idx"], fields["numel"]
    itemsize, numel = dtype.itemsize, math.prod(shape)
    if not 0 <= start <= end <= bucket_bytes:
        raise WeightUpdateError(
            f"{where}: bytes [{start}, {end}) outside the {bucket_bytes}-byte bucket"
        )
    if end - start != numel * itemsize:
        raise WeightUpdateError(
            f"{where}: {end - start} bytes for shape {shape} of {str(dtype).removeprefix('torch.')}"
        )
    if nbytes != end - start:
        raise WeightUpdateError(f"{where}.numel {nbytes} != end_idx - start_idx {end - start}")
    if start % itemsize:
        raise WeightUpdateError(f"{where}: offset {start} not aligned to {itemsize}")
    return FlattenedTensorMetadata(name, torch.Size(shape), dtype, start, end, nbytes)


def check_bucket_payload(payload):
    """A decoded ``flattened_bucket`` payload: ``{"flattened_tensor": 1-D uint8, "metadata":
    [FlattenedTensorMetadata, ...]}`` whose entries lie inside the buffer and agree with their
    own shape and dtype. Runs before the bucket is unpacked; returns the flat tensor and the
    checked metadata."""
    if not isinstance(payload, dict) or {"flattened_tensor", "metadata"} - payload.keys():
        raise WeightUpdateError(
            "flattened_bucket payload must be a dict with flattened_tensor and metadata"
        )
    flat, metadata = payload["flattened_tensor"], payload["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise WeightUpdateError("flattened_tensor must be a 1-D uint8 tensor")
    if not isinstance(metadata, list):
        raise WeightUpdateError(f"metadata must be a list, got {type(metadata).__name__}")
    return flat, [check_metadata(i, meta, flat.numel()) for i, meta in enumerate(metadata)]


def group_body_problem(body: dict, name, backend) -> str | None:
    """What is wrong with an /init_weights_update_group body (None when it is well-formed)."""
    if not isinstance(body["master_address"], str) or not body["master_address"]:
        return "master_address must be a host name or address"
    for key in ("master_port", "rank_offset", "world_size"):
        if type(body[key]) is not int:
            return f"{key} must be an int, got {body[key]!r}"
    if not 0 < body["master_port"] < 65536:
        return f"master_port must be in [1, 65535], got {body['master_port']}"
    if not 0 < body["rank_offset"] < body["world_size"]:
        return (
            f"rank_offset must be in [1, world_size), got {body['rank_offset']} with world_size "
            f"{body['world_size']} (rank 0 is the trainer)"
        )
    if not isinstance(name, str) or not name:
        return "group_name must be a non-empty string"
    if backend not in ("nccl", "gloo"):
        return f"backend must be nccl or gloo, got {backend!r}"
    return None
