"""Unpickling of weight payloads that can only map transport handles (never ``pickle.loads``).

``/update_weights_from_tensor`` receives base64 ForkingPickler dumps of named tensors or of a
flattened bucket. The payload contract (docs/engine.md) admits exactly what a transfer
produces, and each admitted callable is replaced by a checked one:

* on a CPU engine, torch's shared-memory *file* reduction (``rebuild_storage_filename``), only
  for segment names torch itself creates (``/torch_<pid>_<n>_<n>``), a ``torch_shm_manager``
  socket of torch's own directory layout, and a size the segment really holds
  (:func:`check_shm_file_args`): a mapping past the end of a segment would fault on access;
* on a CUDA engine, CUDA IPC handles (``rebuild_cuda_tensor``), the view checked against the
  shared storage's size before it is opened;
* ``rebuild_typed_storage`` and ``rebuild_tensor`` over those storages: every tensor's size,
  stride and offset are checked against its storage before any view is made (torch's
  ``set_`` would grow a storage too small for the view: heap bytes would become a tensor);
* bucket metadata (ours, or SGLang's class path; validated field by field by
  :func:`~miles_launch.builtin_engine.weight_checks.check_bucket_payload`), plain containers,
  ``torch.Size``, dtypes.

The classes a transfer names as arguments (``torch.Tensor``, ``Parameter``,
``UntypedStorage``, and ``TypedStorage``, which torch's CUDA reduction names) resolve to inert
tokens: no constructor that allocates or fills storage
can be called (``torch.Tensor(...)``, ``UntypedStorage([...])``, ``copyreg`` reconstructors).
No fd passing (``rebuild_storage_fd``, ``DupFd``), no arbitrary file names, no other callable.
The storages one payload maps may hold at most ``max_bytes`` bytes together (the request's
byte budget).

Two gates, both before any object is built from a refused name: :func:`scan_globals` walks the
pickle's opcodes and refuses the first global outside the allowlist (one line naming it), and
:class:`AllowlistUnpickler` resolves only allowlisted globals while it loads (the same rule,
enforced again where names are resolved). A refusal carries no traceback of the decoding (no
frame of it keeps a mapped storage alive after the request).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import pickle
import pickletools
import re
import traceback

import torch
from miles_sync.buckets import SGLANG_METADATA_MODULE, FlattenedTensorMetadata
from torch.multiprocessing import reductions

_TORCH_DTYPES = (
    "bfloat16 bool complex128 complex64 float16 float32 float64 float8_e4m3fn float8_e4m3fnuz "
    "float8_e5m2 float8_e5m2fnuz float8_e8m0fnu half float double int int8 int16 int32 int64 "
    "long short uint8 uint16 uint32 uint64 cfloat cdouble"
).split()

_REDUCTIONS = "torch.multiprocessing.reductions"


class _ClassToken:
    """What a payload's reference to a tensor or storage class resolves to: an argument the
    checked rebuilds understand, never a callable (so the payload cannot construct one)."""

    __slots__ = ("cls",)

    def __init__(self, cls: type):
        object.__setattr__(self, "cls", cls)

    def __setattr__(self, name, value):  # pickle's BUILD must not rewrite a shared token
        raise UnsafePayloadError(f"payload refused: {self!r} cannot be modified")

    def __repr__(self) -> str:
        return f"<class {self.cls.__module__}.{self.cls.__qualname__}>"


_TENSOR, _PARAMETER = _ClassToken(torch.Tensor), _ClassToken(torch.nn.Parameter)
_STORAGE = _ClassToken(torch.UntypedStorage)
# torch's CUDA reduction names ``type(tensor._typed_storage())``, the TypedStorage class
_TYPED_STORAGE = _ClassToken(torch.TypedStorage)
_TOKENS = {
    ("torch", "Tensor"): _TENSOR,
    ("torch.nn.parameter", "Parameter"): _PARAMETER,
    ("torch.storage", "UntypedStorage"): _STORAGE,
    ("torch.storage", "TypedStorage"): _TYPED_STORAGE,
}

#: Globals any payload may name (CPU and CUDA engines alike).
COMMON_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    [("builtins", "set"), ("builtins", "frozenset"), ("collections", "OrderedDict")]
    + [("torch", "Size")]
    + list(_TOKENS)
    + [(_REDUCTIONS, "rebuild_tensor"), (_REDUCTIONS, "rebuild_typed_storage")]
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

#: Default byte budget of one payload's storages (the engine passes its own, from the model).
DEFAULT_MAX_BYTES = 1 << 34

# torch names its segments "/torch_<pid>_<random>_<counter>" (libshm's NewProcessWideShmHandle)
# and its manager socket "manager.sock" inside a "torch-shm-dir-" temporary directory (mkdtemp).
_SHM_NAME = re.compile(rb"/torch_\d+_\d+_\d+")
_MANAGER_SOCKET = re.compile(rb"(/[A-Za-z0-9_.-]+)*/torch-shm-dir-[A-Za-z0-9]+/manager\.sock")
_SHM_DIR = "/dev/shm"


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
    manager socket, and a size that is a non-negative int the segment really holds."""
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
    try:
        held = os.stat(os.path.join(_SHM_DIR, handle.decode()[1:])).st_size
    except OSError:
        raise UnsafePayloadError(
            f"payload refused: shared-memory segment {handle.decode()} does not exist"
        ) from None
    if size > held:
        raise UnsafePayloadError(
            f"payload refused: shared-memory segment {handle.decode()} holds {held} bytes, "
            f"the payload claims {size}"
        )


def check_view(what: str, size, stride, offset, dtype: torch.dtype, storage_bytes: int):
    """A view ``(size, stride, offset)`` of ``dtype`` elements lies inside a storage of
    ``storage_bytes`` bytes (checked before the view is made: torch would grow the storage)."""
    if not isinstance(size, tuple) or not all(type(d) is int and d >= 0 for d in size):
        raise UnsafePayloadError(f"payload refused: {what}: size {size!r}")
    if (
        not isinstance(stride, tuple)
        or len(stride) != len(size)
        or not all(type(d) is int and d >= 0 for d in stride)
    ):
        raise UnsafePayloadError(f"payload refused: {what}: stride {stride!r} for size {size}")
    if type(offset) is not int or offset < 0:
        raise UnsafePayloadError(f"payload refused: {what}: storage offset {offset!r}")
    if not isinstance(dtype, torch.dtype):
        raise UnsafePayloadError(f"payload refused: {what}: dtype {dtype!r}")
    numel = 1
    for d in size:
        numel *= d
    last = offset + sum((d - 1) * s for d, s in zip(size, stride)) if numel else offset - 1
    if (last + 1) * dtype.itemsize > storage_bytes:
        raise UnsafePayloadError(
            f"payload refused: {what}: size {list(size)}, stride {list(stride)}, offset {offset} "
            f"of {str(dtype).removeprefix('torch.')} reaches past its {storage_bytes}-byte storage"
        )


def _tensor_class(token, what: str) -> type:
    if token is not _TENSOR and token is not _PARAMETER:
        raise UnsafePayloadError(f"payload refused: {what}: tensor class {token!r}")
    return token.cls


def _size(dims=()) -> torch.Size:
    if not isinstance(dims, (tuple, list)) or not all(type(d) is int and d >= 0 for d in dims):
        raise UnsafePayloadError(f"payload refused: torch.Size({dims!r})")
    return torch.Size(dims)


class AllowlistUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only :func:`allowed_globals` of its device type, to
    checked rebuilds and inert class tokens; its storages hold at most ``max_bytes``."""

    def __init__(self, file, device_type: str = "cpu", max_bytes: int = DEFAULT_MAX_BYTES):
        super().__init__(file)
        self.allowed = allowed_globals(device_type)
        self.max_bytes = max_bytes
        self.mapped_bytes = 0
        # the storages this payload mapped (only these may back its tensors)
        self._storages: dict[int, torch.UntypedStorage] = {}
        self._metadata_class = type(
            "FlattenedTensorMetadata", (FlattenedTensorMetadata,), {"__module__": __name__}
        )

    def find_class(self, module: str, name: str):
        key = (module, name)
        if key not in self.allowed:
            raise _refused(module, name)
        # What BUILD could modify is made for this payload: the metadata class and torch.Size
        # are fresh objects per unpickler, so nothing a payload sets on them outlives it.
        if key in _METADATA_CLASSES:
            return self._metadata_class
        if key in _TOKENS:
            return _TOKENS[key]
        if key == ("torch", "Size"):
            return lambda dims=(): _size(dims)
        if module == _REDUCTIONS:
            return getattr(self, f"_{name}")
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise UnsafePayloadError("payload refused: persistent ids are not allowed")

    def _charge(self, nbytes: int) -> None:
        self.mapped_bytes += nbytes
        if self.mapped_bytes > self.max_bytes:
            raise UnsafePayloadError(
                f"payload refused: its storages exceed the {self.max_bytes}-byte budget of a "
                "request"
            )

    def _keep(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        self._storages[id(storage)] = storage
        return storage

    def _rebuild_storage_filename(self, cls, manager, handle, size, dtype=None):
        if cls is not _STORAGE or dtype is not None:
            raise UnsafePayloadError(f"payload refused: storage class {cls!r}, dtype {dtype!r}")
        check_shm_file_args(manager, handle, size)
        self._charge(size)
        return self._keep(
            reductions.rebuild_storage_filename(torch.UntypedStorage, manager, handle, size)
        )

    def _rebuild_typed_storage(self, storage, dtype):
        if id(storage) not in self._storages or not isinstance(dtype, torch.dtype):
            raise UnsafePayloadError(
                f"payload refused: rebuild_typed_storage({type(storage).__name__}, {dtype!r})"
            )
        return torch.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)

    def _rebuild_tensor(self, cls, storage, metadata):
        cls = _tensor_class(cls, "rebuild_tensor")
        if not (
            isinstance(storage, torch.TypedStorage)
            and id(storage._untyped_storage) in self._storages
        ):
            raise UnsafePayloadError(
                f"payload refused: rebuild_tensor of a {type(storage).__name__}, not a mapped "
                "storage"
            )
        if not isinstance(metadata, tuple) or len(metadata) != 4:
            raise UnsafePayloadError(f"payload refused: rebuild_tensor metadata {metadata!r}")
        offset, size, stride, requires_grad = metadata
        if not isinstance(requires_grad, bool):
            raise UnsafePayloadError(f"payload refused: requires_grad {requires_grad!r}")
        untyped = storage._untyped_storage
        check_view("rebuild_tensor", size, stride, offset, storage.dtype, untyped.nbytes())
        tensor = torch.empty((0,), dtype=storage.dtype).set_(untyped, offset, size, stride)
        if cls is torch.nn.Parameter:
            return torch.nn.Parameter(tensor, requires_grad=requires_grad)
        return tensor

    def _rebuild_cuda_tensor(
        self,
        tensor_cls,
        tensor_size,
        tensor_stride,
        tensor_offset,
        storage_cls,
        dtype,
        storage_device,
        storage_handle,
        storage_size_bytes,
        storage_offset_bytes,
        *rest,
    ):
        cls = _tensor_class(tensor_cls, "rebuild_cuda_tensor")
        if storage_cls is not _STORAGE and storage_cls is not _TYPED_STORAGE:
            raise UnsafePayloadError(f"payload refused: storage class {storage_cls!r}")
        if type(storage_size_bytes) is not int or storage_size_bytes < 0:
            raise UnsafePayloadError(f"payload refused: storage size {storage_size_bytes!r}")
        if type(storage_offset_bytes) is not int or storage_offset_bytes < 0:
            raise UnsafePayloadError(f"payload refused: storage offset {storage_offset_bytes!r}")
        if type(storage_device) is not int or storage_device < 0:
            raise UnsafePayloadError(f"payload refused: storage device {storage_device!r}")
        if not isinstance(storage_handle, bytes) or len(rest) != 5:
            raise UnsafePayloadError("payload refused: malformed CUDA IPC handle")
        check_view(
            "rebuild_cuda_tensor",
            tensor_size,
            tensor_stride,
            tensor_offset,
            dtype,
            storage_size_bytes,
        )
        self._charge(storage_size_bytes)
        return reductions.rebuild_cuda_tensor(
            cls,
            tensor_size,
            tensor_stride,
            tensor_offset,
            torch.UntypedStorage,
            dtype,
            storage_device,
            storage_handle,
            storage_size_bytes,
            storage_offset_bytes,
            *rest,
        )


def safe_loads(data: bytes, device_type: str = "cpu", max_bytes: int = DEFAULT_MAX_BYTES):
    """Unpickle ``data`` under the allowlist of an engine of ``device_type``, mapping at most
    ``max_bytes`` of storage. A failure is an :class:`UnsafePayloadError` without a traceback
    of the decoding: what the payload mapped is released when the error is."""
    scan_globals(data, allowed_globals(device_type))
    unpickler = AllowlistUnpickler(io.BytesIO(data), device_type, max_bytes)
    try:
        return unpickler.load()
    except UnsafePayloadError as exc:  # one of ours: its message is the answer
        message = str(exc)
        traceback.clear_frames(exc.__traceback__)
    except Exception as exc:  # malformed opcodes, a failed rebuild (missing segment, ...)
        message = f"payload could not be decoded: {type(exc).__name__}: {exc}"
        traceback.clear_frames(exc.__traceback__)
    finally:
        unpickler.memo.clear()
        unpickler._storages.clear()
    raise UnsafePayloadError(message)  # outside the handler: no context holding the payload


def decode_serialized(
    data: str | bytes, device_type: str = "cpu", max_bytes: int = DEFAULT_MAX_BYTES
):
    """Decode one ``serialized_named_tensors`` entry: base64 text (or raw pickle bytes)."""
    if isinstance(data, str):
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise UnsafePayloadError(
                f"serialized_named_tensors entry is not base64: {exc}"
            ) from None
    elif isinstance(data, (bytes, bytearray)):
        raw = bytes(data)
    else:
        raise UnsafePayloadError(
            f"serialized_named_tensors entry must be a base64 string, got {type(data).__name__}"
        )
    return safe_loads(raw, device_type, max_bytes)
