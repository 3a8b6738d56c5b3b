"""The reference policy (``--ref-load``): a host copy of this rank's shards, swapped into the
actor's module for the reference log-prob pass (the seeds' system does the same).

Only the parameters are swapped, in place (the DDP buffers and the optimizer keep pointing at
the same storage), so nothing is rebuilt: ``swapped_in`` copies the actor out to host memory,
the reference in, runs the body, and copies the actor back bit for bit. ``--ref-load`` may be an
HF directory (converted through the bridge) or a torch_dist checkpoint directory (the tracker
picks the iteration). ``--ref-update-interval N`` copies the actor into the reference every N
rollouts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from miles_core.args.parsed import ParsedArgs
from miles_core.checkpoint_layout import resolve_load

from miles_megatron.hf_weights import HFCheckpoint, load_hf_into_model
from miles_megatron.sharding import unwrap
from miles_megatron.torch_dist import load_model_weights


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
    out.copy_(t.detach(), non_blocking=False)
    return out


class ReferenceModel:
    """Host tensors of the reference's parameters, one per actor parameter (same layout)."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.params = params

    @classmethod
    def from_actor(cls, model: torch.nn.Module) -> ReferenceModel:
        return cls({n: _host_copy(p) for n, p in unwrap(model).named_parameters()})

    @classmethod
    def load(cls, model: torch.nn.Module, ref_load: str, bridge, margs, tp: int) -> ReferenceModel:
        """Read ``ref_load`` (HF dir or torch_dist checkpoint) into the actor, keep a host copy,
        and put the actor's own weights back."""
        actor = cls.from_actor(model)
        if (Path(ref_load) / "config.json").is_file():
            load_hf_into_model(unwrap(model), HFCheckpoint(ref_load), bridge, margs, tp)
        else:
            resolved = resolve_load(ref_load)
            if resolved is None:
                raise ValueError(f"--ref-load {ref_load}: no config.json and no checkpoint tracker")
            load_model_weights(model, resolved.path)
        ref = cls.from_actor(model)
        actor.copy_into(model)
        return ref

    def copy_into(self, model: torch.nn.Module) -> None:
        with torch.no_grad():
            for name, param in unwrap(model).named_parameters():
                param.copy_(self.params[name], non_blocking=False)

    def update_from(self, model: torch.nn.Module) -> None:
        """``--ref-update-interval``: the reference becomes the current actor."""
        with torch.no_grad():
            for name, param in unwrap(model).named_parameters():
                self.params[name].copy_(param.detach())

    @contextlib.contextmanager
    def swapped_in(self, model: torch.nn.Module) -> Iterator[None]:
        """Run the body with the reference's weights in ``model``; restore the actor after."""
        actor = ReferenceModel.from_actor(model)
        self.copy_into(model)
        try:
            yield
        finally:
            actor.copy_into(model)


def wants_reference(args: ParsedArgs) -> bool:
    return args.ref_mode == "ref"
