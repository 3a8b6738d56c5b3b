"""Weights of the built-in engine: updates (tensor / distributed / disk) and memory release.

Every update ends in :meth:`WeightStore.load_named`: each ``(name, tensor)`` is copied into
the parameter (or buffer) of that HF name, cast to the parameter's dtype; a checkpoint's
per-expert name goes into its slice of transformers' batched expert parameter
(:mod:`~miles_launch.builtin_engine.expert_names`). Every tensor of a call is checked first
(:mod:`~miles_launch.builtin_engine.weight_checks`: name, shape, dtype kind; a disk update reads
every file's header before loading any): a mismatch fails the whole call with a message naming
the tensor, and nothing of it has been loaded.
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from miles_sync.buckets import bucket_layout, unpack_bucket
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

from miles_launch.builtin_engine.expert_names import batched_expert_slice
from miles_launch.builtin_engine.safe_unpickle import (
    DEFAULT_MAX_BYTES,
    UnsafePayloadError,
    decode_serialized,
)
from miles_launch.builtin_engine.weight_checks import (
    WeightUpdateError,
    check_bucket_payload,
    check_fits,
    plan_load,
)

WEIGHT_UPDATE_TIMEOUT = datetime.timedelta(minutes=10)


class WeightStore:
    """The model's parameters and buffers by HF name, with release/resume of their memory."""

    def __init__(self, model: torch.nn.Module, device: torch.device, cpu_backup: bool = False):
        self.model = model
        self.device = device
        self.cpu_backup = cpu_backup
        # Parameters and persistent buffers (what a checkpoint holds; tied weights appear
        # under each name). Non-persistent buffers (e.g. rotary inv_freq) are derived, small,
        # and stay put.
        self.tensors: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
        self._specs = {name: (t.shape, t.dtype) for name, t in self.tensors.items()}
        self._backup: dict[str, torch.Tensor] | None = None
        self.released = False

    def resolve(self, name: str) -> torch.Tensor | None:
        """The parameter/buffer of HF name ``name`` (or its slice of a batched expert tensor)."""
        target = self.tensors.get(name)
        return target if target is not None else batched_expert_slice(name, self.tensors)

    @torch.no_grad()
    def load_named(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Check every tensor (:func:`~miles_launch.builtin_engine.weight_checks.plan_load`),
        then copy them all: a mismatch anywhere loads nothing."""
        if self.released:
            raise RuntimeError("weights are released; call /resume_memory_occupation first")
        plan = plan_load(named_tensors, self.resolve)
        for target, tensor in plan:
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
        if self.device.type == "cuda":
            # the reply tells the sender it may reuse the buffer it shared: every copy out of
            # it must be done by then, not merely queued on this process's stream
            torch.cuda.current_stream(self.device).synchronize()
        return len(plan)

    def load_from_disk(self, model_path: str) -> int:
        """Load every ``*.safetensors`` file of a HF checkpoint directory; every file's
        names, shapes and dtypes are checked (from their headers) before any is loaded."""
        path = Path(model_path)
        if not path.is_dir():
            raise FileNotFoundError(f"model_path {model_path!r} is not a directory")
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"model_path {model_path!r} holds no *.safetensors file")
        index = path / "model.safetensors.index.json"
        if index.exists():
            names = set(json.loads(index.read_text())["weight_map"].values())
            files = [path / n for n in sorted(names)]
        if self.released:
            raise RuntimeError("weights are released; call /resume_memory_occupation first")
        for file in files:
            check_safetensors_header(file, self.resolve)
        count = 0
        for file in files:
            count += self.load_named(load_file(str(file), device="cpu").items())
        return count

    def payload_budget(self) -> int:
        """Most bytes one tensor update may map: every named tensor of the model once, at 16
        bytes an element (the widest dtype, complex128), plus 1 MiB. A valid update is never
        larger: each tensor it carries must match a model tensor's shape."""
        return 16 * sum(math.prod(shape) for shape, _ in self._specs.values()) + (1 << 20)

    def weights_bytes(self) -> int:
        unique = {id(t): t for t in self.tensors.values()}
        return sum(t.numel() * t.element_size() for t in unique.values())

    @torch.no_grad()
    def release(self) -> None:
        """Free every parameter/buffer's storage (backing it up on the CPU first if asked)."""
        if self.released:
            return
        if self.cpu_backup:
            self._backup = {n: t.detach().to("cpu", copy=True) for n, t in self.tensors.items()}
        for tensor in {id(t): t for t in self.tensors.values()}.values():
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        self.released = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.no_grad()
    def resume(self) -> None:
        """Reallocate the storage: from the CPU backup, else uninitialised (re-sync weights)."""
        if not self.released:
            return
        seen = set()
        for name, tensor in self.tensors.items():
            if id(tensor) in seen:  # tied: already restored under another name
                continue
            seen.add(id(tensor))
            shape, dtype = self._specs[name]
            if self._backup is not None:
                tensor.data = self._backup[name].to(self.device)
            else:
                tensor.data = torch.empty(shape, dtype=dtype, device=self.device)
        self._backup = None
        self.released = False


def check_safetensors_header(file: Path, resolve) -> None:
    """Every tensor of a safetensors file fits the model (read from its header only)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                sliced = f.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(sliced.get_dtype())
                if dtype is None:
                    raise WeightUpdateError(f"{name}: unsupported dtype {sliced.get_dtype()}")
                target = resolve(name)
                if target is None:
                    raise WeightUpdateError(f"model has no parameter or buffer named {name!r}")
                check_fits(name, sliced.get_shape(), dtype, target)
    except WeightUpdateError as exc:
        raise WeightUpdateError(f"{file.name}: {exc}") from None


_SAFETENSORS_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


# ---- /update_weights_from_tensor ------------------------------------------------------------
def decode_tensor_payload(
    serialized: list,
    load_format: str | None,
    device_type: str = "cpu",
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> list[tuple[str, torch.Tensor]]:
    """``serialized_named_tensors`` (one entry per TP rank; this engine has one) -> named tensors.

    ``load_format`` ``None``/``"direct"``: the entry is a list of ``(name, tensor)``;
    ``"flattened_bucket"``: a dict ``{"flattened_tensor": uint8 1-D, "metadata": [...]}``.
    The entry is unpickled under the payload allowlist of an engine of ``device_type``
    (:mod:`~miles_launch.builtin_engine.safe_unpickle`), its storages at most ``max_bytes``; a
    bucket's metadata is checked
    (:func:`~miles_launch.builtin_engine.weight_checks.check_bucket_payload`) before it is unpacked.
    """
    if load_format not in (None, "direct", "flattened_bucket"):
        raise WeightUpdateError(
            f"load_format must be null, 'direct' or 'flattened_bucket', got {load_format!r}"
        )
    if not isinstance(serialized, list) or len(serialized) != 1:
        n = len(serialized) if isinstance(serialized, list) else type(serialized).__name__
        raise ValueError(
            f"serialized_named_tensors must hold one entry (this engine has tp size 1), got {n}"
        )
    payload = decode_serialized(serialized[0], device_type, max_bytes)
    if load_format in (None, "direct"):
        if not isinstance(payload, (list, tuple)) or not all(
            isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[1], torch.Tensor)
            for item in payload
        ):
            raise UnsafePayloadError("direct payload must be a list of (name, tensor) pairs")
        return [(name, tensor) for name, tensor in payload]
    if load_format == "flattened_bucket":
        flat, metadata = check_bucket_payload(payload)
        return unpack_bucket(flat, metadata)
    raise ValueError(
        f"load_format must be null, 'direct' or 'flattened_bucket', got {load_format!r}"
    )


# ---- /init_weights_update_group and /update_weights_from_distributed -------------------------
def join_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    is_master: bool = False,
    timeout: datetime.timedelta = WEIGHT_UPDATE_TIMEOUT,
):
    """A process group on ``PrefixStore(group_name, TCPStore(master_address, master_port))``.

    This is how SGLang's engine joins (its ``init_custom_process_group``): rank 0 (the
    trainer, ``is_master=True``) hosts the store, engines join with ``is_master=False``. The
    group needs no default process group. Blocks until all ``world_size`` ranks joined.
    """
    store = dist.TCPStore(
        master_address, int(master_port), world_size, is_master=is_master, timeout=timeout
    )
    store = dist.PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_weight_update_group(pg) -> None:
    dist.destroy_process_group(pg)


def receive_broadcast(
    pg,
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    load_format: str | None,
    device: torch.device,
) -> list[tuple[str, torch.Tensor]]:
    """Receive tensors broadcast from rank 0: one per name in list order, or (flattened_bucket)
    one uint8 bucket laid out densely in list order by :func:`miles_sync.buckets.bucket_layout`,
    as SGLang's ``FlattenedTensorBucket.empty`` lays it out (and refused where SGLang refuses
    it: an unaligned offset), before anything is received."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(
            f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}"
        )
    torch_dtypes = []
    for dtype in dtypes:
        value = getattr(torch, str(dtype).removeprefix("torch."), None)
        if not isinstance(value, torch.dtype):
            raise ValueError(f"dtypes: unknown dtype {dtype!r}")
        torch_dtypes.append(value)
    if load_format == "flattened_bucket":
        metadata, total = bucket_layout(zip(names, shapes, torch_dtypes))
        flat = torch.empty(total, dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=0, group=pg)
        return unpack_bucket(flat, metadata)
    if load_format not in (None, "direct"):
        raise ValueError(f"load_format must be null or 'flattened_bucket', got {load_format!r}")
    out = []
    for name, dtype, shape in zip(names, torch_dtypes, shapes):
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, src=0, group=pg)
        out.append((name, tensor))
    return out
