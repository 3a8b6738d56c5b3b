"""Per-document state reset for stateful layers under THD sequence packing.

Packing concatenates several samples into one row with ``position_ids`` restarting at 0 for
each. Attention layers are masked per document by transformers (it derives a block-diagonal
mask from the position restarts). Recurrent layers (Gated-DeltaNet, Mamba2) are not: their
convolution and state run straight across the row, so a document would see its predecessor.

:func:`install_document_reset` fixes that: a forward pre-hook on the model reads the packed
``position_ids`` (batch of one row) and records the document lengths; the listed stateful
modules then run once per document, on that document's slice, from a zero state, and their
outputs are concatenated. Unpacked inputs (no restart) take the original path unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def document_lengths(position_ids: torch.Tensor) -> list[int] | None:
    """Lengths of the documents of a packed ``(1, T)`` row; ``None`` if it holds one or is batched."""
    if position_ids.dim() != 2 or position_ids.shape[0] != 1:
        return None
    pos = position_ids[0]
    starts = torch.nonzero(pos[1:] <= pos[:-1]).flatten() + 1
    if starts.numel() == 0:
        return None
    bounds = [0, *starts.tolist(), pos.numel()]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def install_document_reset(model: nn.Module, class_names: set[str]) -> int:
    """Make every module of ``model`` whose class is in ``class_names`` reset per document.

    Returns the number of modules patched (an error if none: the spec names a wrong class).
    """
    current: dict[str, Any] = {"lengths": None}

    def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
        position_ids = kwargs.get("position_ids")
        current["lengths"] = None if position_ids is None else document_lengths(position_ids)

    model.register_forward_pre_hook(record, with_kwargs=True)
    patched = 0
    for module in model.modules():
        if type(module).__name__ not in class_names:
            continue
        original = module.forward

        def forward(hidden_states, *args, _original=original, **kwargs):
            lengths = current["lengths"]
            if lengths is None:
                return _original(hidden_states, *args, **kwargs)
            kwargs.pop("attention_mask", None)
            pieces = [
                _original(piece, *args, **kwargs) for piece in hidden_states.split(lengths, dim=1)
            ]
            return torch.cat(pieces, dim=1)

        module.forward = forward
        patched += 1
    if not patched:
        raise ValueError(f"install_document_reset: no module of class {sorted(class_names)}")
    return patched
