"""``--update-weight-verify``: after a publish, read every published tensor back from each engine
and compare it with the trainer's, bit for bit.

While rank 0 iterates the weight source, :class:`SentDigests` records each tensor's shape and the
xxh3-128 of its raw bytes, cast to each engine's dtype (the engine casts what it receives to the
dtype it serves in: ``dtype`` of ``/get_server_info``, or the checkpoint's for ``auto``). After
the round, :func:`verify_engines` reads each tensor with SGLang's ``/get_weights_by_name`` (all
rows, as float32 values: exact for float32, bfloat16 and float16), casts it back to the engine's
dtype and compares digests. No copy of the weights is kept, only their digests. The check's
result carries :func:`state_digest` of the tensors as sent, so a test can compare the published
state with a checkpoint the trainer saved.

The check reads the engines' tensors by HF name, so it needs engines that serve whole tensors
under those names (the built-in engine; SGLang at tensor-parallel size 1). It costs one HTTP
reply of every tensor, as JSON, per engine: a debugging check, not for every production publish.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import xxhash
from miles_core.engine import EngineClient, EngineError

from miles_sync.deferred import DeferredTensor
from miles_sync.errors import PublishError

#: Dtypes ``/get_weights_by_name``'s float32 values hold exactly.
EXACT_IN_FLOAT32 = (torch.float32, torch.bfloat16, torch.float16)


def tensor_digest(tensor: torch.Tensor) -> str:
    """xxh3-128 of the tensor's raw bytes (row-major)."""
    raw = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()
    return xxhash.xxh3_128_hexdigest(raw)


def state_digest(digests: dict[str, str]) -> str:
    """One xxh3-128 over every ``name -> tensor digest`` pair, in name order."""
    lines = "".join(f"{name} {digests[name]}\n" for name in sorted(digests))
    return xxhash.xxh3_128_hexdigest(lines.encode())


def tensors_digest(pairs: Iterable[tuple[str, torch.Tensor]]) -> str:
    """:func:`state_digest` of ``(name, tensor)`` pairs."""
    return state_digest({name: tensor_digest(tensor) for name, tensor in pairs})


def engine_dtype(client: EngineClient) -> torch.dtype | None:
    """The dtype the engine serves in (``None``: ``auto``, the dtype it is sent)."""
    name = str(client.get_server_info().get("dtype", "auto"))
    if name == "auto":
        return None
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise PublishError(f"--update-weight-verify: {client.base_url} serves dtype {name!r}")
    return dtype


@dataclass
class SentDigests:
    """Shapes, dtypes and digests of the tensors one publish sent (``targets``: the engines'
    dtypes; ``None`` stands for the dtype each tensor is sent in)."""

    targets: set[torch.dtype | None]
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    digests: dict[tuple[str, torch.dtype], str] = field(default_factory=dict)
    as_sent: dict[str, str] = field(default_factory=dict)

    def watch(
        self, source: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``source`` unchanged, recording each tensor as it passes (a deferred tensor once it
        filled its bucket range: the bytes sent)."""
        for name, tensor in source:
            if isinstance(tensor, DeferredTensor):
                yield name, tensor.then(lambda out, name=name: self.record(name, out))
                continue
            self.record(name, tensor)
            yield name, tensor

    def record(self, name: str, tensor: torch.Tensor) -> None:
        self.specs[name] = (tuple(tensor.shape), tensor.dtype)
        self.as_sent[name] = tensor_digest(tensor)
        for target in self.targets:
            dtype = tensor.dtype if target is None else target
            if dtype not in EXACT_IN_FLOAT32:
                raise PublishError(
                    f"--update-weight-verify: {name} is {dtype}, which /get_weights_by_name "
                    "cannot return exactly (float32 values)"
                )
            cast = self.as_sent[name] if dtype == tensor.dtype else tensor_digest(tensor.to(dtype))
            self.digests[name, dtype] = cast


def read_back(client: EngineClient, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The engine's whole tensor ``name`` as float32."""
    rows = shape[0] if shape else 1
    return torch.tensor(client.get_weights_by_name(name, max(rows, 1)), dtype=torch.float32)


def verify_engines(
    clients: Sequence[EngineClient],
    dtypes: dict[str, torch.dtype | None],
    sent: SentDigests,
    version: int,
) -> dict[str, int]:
    """Raise :class:`PublishError` naming the first engine and tensors that differ from what
    was sent; else ``{"tensors": n, "engines": m, "state": state_digest(as sent)}``."""
    if not sent.specs:
        raise PublishError(f"--update-weight-verify: weight version {version} sent no tensors")
    for client in clients:
        differ = []
        for name, (shape, sent_dtype) in sent.specs.items():
            dtype = dtypes[client.base_url] or sent_dtype
            try:
                served = read_back(client, name, shape)
            except EngineError as error:
                raise PublishError(
                    f"--update-weight-verify: {client.base_url} cannot return {name}: {error}"
                ) from error
            if tuple(served.shape) != shape:
                differ.append(f"{name} (shape {list(served.shape)}, sent {list(shape)})")
            elif tensor_digest(served.to(dtype)) != sent.digests[name, dtype]:
                differ.append(name)
        if differ:
            raise PublishError(
                f"weight version {version} on {client.base_url} differs from the trainer's "
                f"(bit for bit) in {len(differ)} of {len(sent.specs)} tensors: "
                f"{', '.join(differ[:5])}{' ...' if len(differ) > 5 else ''}"
            )
    return {
        "tensors": len(sent.specs),
        "engines": len(clients),
        "state": state_digest(sent.as_sent),
    }
