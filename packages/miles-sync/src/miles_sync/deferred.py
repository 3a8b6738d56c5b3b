"""Deferred tensors: a weight source's tensor written straight into the bucket that carries it.

A weight source yields ``(name, tensor)`` pairs. A :class:`DeferredTensor` stands where a tensor
would: it has a shape, a dtype and a device (what bucket planning reads), and instead of values
a ``fill(out)`` that writes them into a given output of that shape and dtype. The bucket slots
(:class:`~miles_sync.bucket_slots.BucketSlots`) call ``fill`` on the slot's own view, so the
bytes are written once, where the transport sends them from (the FSDP source all-gathers a
parameter's shards straight into the slot). Anything that needs a real tensor calls
:func:`materialize`.

A fill may be collective (an all-gather): every rank must fill the same deferred tensors in the
same order. Only a transport in which every rank packs every bucket in lock step may receive
them (``ipc``); :func:`fill_source` asks a source for them there, and every other mode iterates
the source as before (:func:`materialized` turns any that still arrive into tensors, in stream
order). A source offers them through a ``deferred()`` method returning the same pairs, in the
same order, some of them deferred; a source without one is iterated as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch


class DeferredTensor:
    """A tensor of ``shape`` and ``dtype`` whose values ``fill(out)`` writes into ``out``
    (contiguous, of that shape and dtype); :meth:`materialize` fills a new one on ``device``."""

    def __init__(
        self,
        shape: torch.Size | tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str,
        fill: Callable[[torch.Tensor], None],
    ):
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self._fill = fill

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    @torch.no_grad()
    def fill(self, out: torch.Tensor) -> None:
        """Write the values into ``out``."""
        if out.shape != self.shape or out.dtype != self.dtype or not out.is_contiguous():
            raise ValueError(
                f"a deferred {tuple(self.shape)} {self.dtype} tensor cannot fill a "
                f"{tuple(out.shape)} {out.dtype} output (contiguous: {out.is_contiguous()})"
            )
        self._fill(out)

    def materialize(self) -> torch.Tensor:
        """The values as a new tensor on ``device``."""
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.fill(out)
        return out

    def then(self, after: Callable[[torch.Tensor], None]) -> DeferredTensor:
        """The same tensor, calling ``after(out)`` once it filled ``out`` (a recorder)."""

        def fill(out: torch.Tensor) -> None:
            self.fill(out)
            after(out)

        return DeferredTensor(self.shape, self.dtype, self.device, fill)

    def __repr__(self) -> str:
        return f"DeferredTensor({tuple(self.shape)}, {self.dtype}, {self.device})"


def materialize(tensor: torch.Tensor | DeferredTensor) -> torch.Tensor:
    """``tensor`` itself, or a deferred tensor's values as a new tensor."""
    return tensor.materialize() if isinstance(tensor, DeferredTensor) else tensor


def materialized(
    pairs: Iterable[tuple[str, torch.Tensor | DeferredTensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """``pairs`` with every deferred tensor materialised as it passes (in stream order)."""
    for name, tensor in pairs:
        yield name, materialize(tensor)


def fill_source(source: Iterable) -> Iterable:
    """The pairs of ``source`` with deferred tensors where the source offers them (its
    ``deferred()``), else ``source`` itself. Every rank must call this alike."""
    offer = getattr(source, "deferred", None)
    return offer() if callable(offer) else source
