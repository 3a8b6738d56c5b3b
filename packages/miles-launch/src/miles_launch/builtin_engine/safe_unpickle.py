"""Unpickling of weight payloads with an allowlist (never plain ``pickle.loads``).

``/update_weights_from_tensor`` receives base64 ForkingPickler dumps: tensors reduced by
``torch.multiprocessing.reductions`` (shared-memory files or fds on CPU, CUDA IPC handles
on GPU), lists/tuples/dicts, and bucket metadata objects. Only the globals those payloads
need may be resolved; anything else (``os.system``, ``builtins.eval``, arbitrary classes)
raises :class:`UnsafePayloadError` before it could be called.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle

from miles_sync.buckets import SGLANG_METADATA_MODULE, FlattenedTensorMetadata

_TORCH_DTYPES = (
    "bfloat16 bool complex128 complex64 float16 float32 float64 float8_e4m3fn float8_e4m3fnuz "
    "float8_e5m2 float8_e5m2fnuz float8_e8m0fnu half float double int int8 int16 int32 int64 "
    "long short uint8 uint16 uint32 uint64 cfloat cdouble"
).split()

_TORCH_STORAGES = (
    "UntypedStorage BFloat16Storage BoolStorage ByteStorage CharStorage DoubleStorage "
    "FloatStorage HalfStorage IntStorage LongStorage ShortStorage"
).split()

ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    [
        ("builtins", name)
        for name in ("bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset")
        + ("int", "list", "set", "slice", "str", "tuple")
    ]
    + [
        ("collections", "OrderedDict"),
        ("copyreg", "__newobj__"),
        ("copyreg", "_reconstructor"),
        ("torch", "Tensor"),
        ("torch", "Size"),
        ("torch", "device"),
        ("torch", "dtype"),
        ("torch.nn.parameter", "Parameter"),
        ("torch._utils", "_rebuild_tensor"),
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_tensor_v3"),
        ("torch._utils", "_rebuild_parameter"),
        ("torch._tensor", "_rebuild_from_type_v2"),
        ("torch.storage", "UntypedStorage"),
        ("torch.storage", "TypedStorage"),
        ("torch.multiprocessing.reductions", "rebuild_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_meta_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
        ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
        ("torch.multiprocessing.reductions", "rebuild_typed_storage_child"),
        ("multiprocessing.resource_sharer", "DupFd"),
    ]
    + [("torch", name) for name in _TORCH_DTYPES + _TORCH_STORAGES]
)

# Bucket metadata: ours and SGLang's class path both decode to our dataclass.
_METADATA_CLASSES = {
    ("miles_sync.buckets", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    ("miles_sync.buckets", "SGLangFlattenedTensorMetadata"): FlattenedTensorMetadata,
    (SGLANG_METADATA_MODULE, "FlattenedTensorMetadata"): FlattenedTensorMetadata,
}


class UnsafePayloadError(ValueError):
    """A payload names a global outside the allowlist (or is not a valid payload)."""


class AllowlistUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only :data:`ALLOWED_GLOBALS` and metadata classes."""

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_CLASSES:
            return _METADATA_CLASSES[(module, name)]
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise UnsafePayloadError(f"payload refused: global {module}.{name} is not on the allowlist")


def safe_loads(data: bytes):
    """Unpickle ``data`` with :class:`AllowlistUnpickler`."""
    try:
        return AllowlistUnpickler(io.BytesIO(data)).load()
    except UnsafePayloadError:
        raise
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as exc:
        raise UnsafePayloadError(f"payload is not a valid pickle: {exc}") from exc


def decode_serialized(data: str | bytes):
    """Decode one ``serialized_named_tensors`` entry: base64 text (or raw pickle bytes)."""
    if isinstance(data, str):
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise UnsafePayloadError(
                f"serialized_named_tensors entry is not base64: {exc}"
            ) from exc
    else:
        raw = bytes(data)
    return safe_loads(raw)
