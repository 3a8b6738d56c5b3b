"""Unpickling of weight payloads with an allowlist (never plain ``pickle.loads``).

``/update_weights_from_tensor`` receives base64 ForkingPickler dumps of named tensors or of a
flattened bucket. The payload contract (docs/engine.md) admits exactly what a transfer needs:

* on a CUDA engine, CUDA IPC handles (``rebuild_cuda_tensor``);
* on a CPU engine, torch's shared-memory *file* reduction (``rebuild_storage_filename``), and
  only for segment names torch itself creates (``/torch_<pid>_<n>_<n>``) and a
  ``torch_shm_manager`` socket of torch's own directory layout
  (:func:`check_shm_file_args`);
* bucket metadata (ours, or SGLang's class path), plain containers, ``torch.Size``, dtypes.

No fd passing (``rebuild_storage_fd`` and ``multiprocessing.resource_sharer.DupFd``, which
would map whatever file the engine has open), no arbitrary file names, no other callable.

Two gates, both before any object is built from a refused name: :func:`scan_globals` walks the
pickle's opcodes and refuses the first global outside the allowlist (one line naming it), and
:class:`AllowlistUnpickler` resolves only allowlisted globals while it loads (the same rule,
enforced again where names are resolved).
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
import pickletools
import re

import torch
from miles_sync.buckets import SGLANG_METADATA_MODULE, FlattenedTensorMetadata
from torch.multiprocessing import reductions

_TORCH_DTYPES = (
    "bfloat16 bool complex128 complex64 float16 float32 float64 float8_e4m3fn float8_e4m3fnuz "
    "float8_e5m2 float8_e5m2fnuz float8_e8m0fnu half float double int int8 int16 int32 int64 "
    "long short uint8 uint16 uint32 uint64 cfloat cdouble"
).split()

_REDUCTIONS = "torch.multiprocessing.reductions"

#: Globals any payload may name (CPU and CUDA engines alike).
COMMON_GLOBALS: frozenset[tuple[str, str]] = frozenset(
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
        ("torch.storage", "UntypedStorage"),
        ("torch.storage", "TypedStorage"),
        (_REDUCTIONS, "rebuild_tensor"),
        (_REDUCTIONS, "rebuild_typed_storage"),
        (_REDUCTIONS, "rebuild_storage_empty"),
    ]
    + [("torch", name) for name in _TORCH_DTYPES]
)

#: What moves the bytes: shared-memory files on a CPU engine, CUDA IPC handles on a CUDA one.
TRANSPORT_GLOBALS: dict[str, frozenset[tuple[str, str]]] = {
    "cpu": frozenset([(_REDUCTIONS, "rebuild_storage_filename")]),
    "cuda": frozenset([(_REDUCTIONS, "rebuild_cuda_tensor")]),
}

# Bucket metadata: ours and SGLang's class path both decode to our dataclass.
_METADATA_CLASSES = {
    ("miles_sync.buckets", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    ("miles_sync.buckets", "SGLangFlattenedTensorMetadata"): FlattenedTensorMetadata,
    (SGLANG_METADATA_MODULE, "FlattenedTensorMetadata"): FlattenedTensorMetadata,
}

# torch names its segments "/torch_<pid>_<random>_<counter>" (libshm's NewProcessWideShmHandle)
# and its manager socket "manager.sock" inside a "torch-shm-dir-" temporary directory (mkdtemp).
_SHM_NAME = re.compile(rb"/torch_\d+_\d+_\d+")
_MANAGER_SOCKET = re.compile(rb"(/[A-Za-z0-9_.-]+)*/torch-shm-dir-[A-Za-z0-9]+/manager\.sock")


class UnsafePayloadError(ValueError):
    """A payload names a global outside the allowlist (or is not a valid payload)."""


def allowed_globals(device_type: str) -> frozenset[tuple[str, str]]:
    """The globals a payload may name on an engine of ``device_type`` (``cpu`` or ``cuda``)."""
    if device_type not in TRANSPORT_GLOBALS:
        raise ValueError(f"device_type must be cpu or cuda, got {device_type!r}")
    return COMMON_GLOBALS | TRANSPORT_GLOBALS[device_type] | frozenset(_METADATA_CLASSES)


def _refused(module: str, name: str) -> UnsafePayloadError:
    return UnsafePayloadError(f"payload refused: global {module}.{name} is not on the allowlist")


def scan_globals(data: bytes, allowed: frozenset[tuple[str, str]]) -> None:
    """Refuse ``data`` if its opcodes name a global outside ``allowed``; nothing is built.

    ``GLOBAL``/``INST`` carry the name; ``STACK_GLOBAL`` takes module and name from the two
    strings pushed before it (directly or from the memo). A ``STACK_GLOBAL`` whose operands
    are not such strings, extension codes and persistent ids are refused too."""
    memo: dict[int, object] = {}
    pushed: list[object] = []  # what the last ops pushed: a str, or None for anything else
    try:
        for op, arg, _ in pickletools.genops(data):
            name = op.name
            if name in ("GLOBAL", "INST"):
                module, _, attr = str(arg).partition(" ")
                if (module, attr) not in allowed:
                    raise _refused(module, attr)
                pushed.append(None)
            elif name == "STACK_GLOBAL":
                if len(pushed) < 2 or not all(isinstance(s, str) for s in pushed[-2:]):
                    raise UnsafePayloadError("payload refused: a global whose name is computed")
                module, attr = pushed[-2], pushed[-1]
                if (module, attr) not in allowed:
                    raise _refused(module, attr)
                pushed[-2:] = [None]
            elif name in ("EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID"):
                raise UnsafePayloadError(f"payload refused: opcode {name} is not allowed")
            elif name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
                pushed.append(arg)
            elif name == "MEMOIZE":
                memo[len(memo)] = pushed[-1] if pushed else None
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = pushed[-1] if pushed else None
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                pushed.append(memo.get(arg))
            elif name not in ("PROTO", "FRAME", "STOP"):
                pushed.append(None)
            del pushed[:-2]
    except UnsafePayloadError:
        raise
    except Exception as exc:  # genops: truncated or malformed opcodes
        raise UnsafePayloadError(f"payload is not a valid pickle: {exc}") from exc


def check_shm_file_args(manager, handle, size) -> None:
    """The arguments of ``rebuild_storage_filename`` must name torch's own segment and
    manager socket, and a size that is a non-negative int."""
    if not isinstance(handle, bytes) or not _SHM_NAME.fullmatch(handle):
        raise UnsafePayloadError(
            f"payload refused: shared-memory name {handle!r} is not one torch creates"
        )
    if not isinstance(manager, bytes) or (
        manager and (b".." in manager or not _MANAGER_SOCKET.fullmatch(manager))
    ):
        raise UnsafePayloadError(
            f"payload refused: shared-memory manager {manager!r} is not torch's socket"
        )
    if type(size) is not int or size < 0:
        raise UnsafePayloadError(f"payload refused: shared-memory size {size!r}")


def _checked_rebuild_storage_filename(cls, manager, handle, size, dtype=None):
    check_shm_file_args(manager, handle, size)
    if not (isinstance(cls, type) and issubclass(cls, (torch.UntypedStorage, torch.TypedStorage))):
        raise UnsafePayloadError(f"payload refused: storage class {cls!r}")
    return reductions.rebuild_storage_filename(cls, manager, handle, size, dtype)


class AllowlistUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only :func:`allowed_globals` of its device type."""

    def __init__(self, file, device_type: str = "cpu"):
        super().__init__(file)
        self.allowed = allowed_globals(device_type)

    def find_class(self, module: str, name: str):
        if (module, name) not in self.allowed:
            raise _refused(module, name)
        if (module, name) in _METADATA_CLASSES:
            return _METADATA_CLASSES[(module, name)]
        if (module, name) == (_REDUCTIONS, "rebuild_storage_filename"):
            return _checked_rebuild_storage_filename
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise UnsafePayloadError("payload refused: persistent ids are not allowed")


def safe_loads(data: bytes, device_type: str = "cpu"):
    """Unpickle ``data`` under the allowlist of an engine of ``device_type``."""
    scan_globals(data, allowed_globals(device_type))
    try:
        return AllowlistUnpickler(io.BytesIO(data), device_type).load()
    except UnsafePayloadError:
        raise
    except Exception as exc:  # malformed opcodes, a failed rebuild (missing segment, ...)
        raise UnsafePayloadError(f"payload could not be decoded: {exc}") from exc


def decode_serialized(data: str | bytes, device_type: str = "cpu"):
    """Decode one ``serialized_named_tensors`` entry: base64 text (or raw pickle bytes)."""
    if isinstance(data, str):
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise UnsafePayloadError(
                f"serialized_named_tensors entry is not base64: {exc}"
            ) from exc
    elif isinstance(data, (bytes, bytearray)):
        raw = bytes(data)
    else:
        raise UnsafePayloadError(
            f"serialized_named_tensors entry must be a base64 string, got {type(data).__name__}"
        )
    return safe_loads(raw, device_type)
