"""EMA of the trainable actor parameters, kept as a ``torch.optim.Optimizer``.

``EMAOptimizer.state[param]["ema"]`` holds the average of ``param`` with the same type,
sharding (DTensor) and device as the parameter, so the DCP optimizer-state wrapper saves it
with parameter names and sharding, and sleep/wake moves it like AdamW's state. Only trainable
actor parameters are averaged; buffers and frozen (LoRA base) parameters never are.

Decay (``s`` = the actor's optimizer step count after the rollout's training)::

    decay(s) = init                               if s <= flat_steps
             = min((s - flat_steps) * ramp, max)  otherwise
    ema <- decay * ema + (1 - decay) * actor      (on each rank's local shard)

One :meth:`EMAOptimizer.update` follows each rollout's training; publishing, evaluating or
retrying a publish never advances it. :meth:`EMAOptimizer.use_weights` swaps the averages into
the actor's shards for the duration of a ``with`` block and back (also on an exception),
dropping FSDP's gathered copies on both sides so no forward reads stale unsharded weights.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from miles_core.args.parsed import ParsedArgs
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EMASchedule:
    """``--ema-decay-init``, ``--ema-decay-ramp``, ``--ema-decay-max``, ``--ema-decay-flat-steps``."""

    init: float = 0.001
    ramp: float = 0.001
    max: float = 0.5
    flat_steps: int = 0

    @classmethod
    def from_args(cls, args: ParsedArgs) -> EMASchedule:
        return cls(
            init=args.ema_decay_init,
            ramp=args.ema_decay_ramp,
            max=args.ema_decay_max,
            flat_steps=args.ema_decay_flat_steps,
        )

    def decay(self, step: int) -> float:
        """The decay after ``step`` actor optimizer steps (see the module docstring)."""
        if step <= self.flat_steps:
            return self.init
        return min((step - self.flat_steps) * self.ramp, self.max)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def drop_gathered_copies(model: nn.Module) -> None:
    """Reshard every FSDP unit of ``model``: free unsharded parameters left by a forward."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class EMAOptimizer(torch.optim.Optimizer):
    """Exponential moving average of ``params`` (see the module docstring).

    The schedule lives in the param group (``init``, ``ramp``, ``max``, ``flat_steps``) and
    the last decay used in ``group["last_decay"]``, so both travel in the optimizer state
    dict. Averages start equal to the parameters.
    """

    def __init__(self, params: Iterable[nn.Parameter], schedule: EMASchedule) -> None:
        params = [p for p in params if p.requires_grad]
        if not params:
            raise ValueError("EMAOptimizer: the model has no trainable parameters")
        defaults = {
            "init": schedule.init,
            "ramp": schedule.ramp,
            "max": schedule.max,
            "flat_steps": schedule.flat_steps,
            "last_decay": -1.0,
            "updates": 0,
        }
        super().__init__(params, defaults)
        self.seed_from_params()

    @property
    def schedule(self) -> EMASchedule:
        g = self.param_groups[0]
        return EMASchedule(g["init"], g["ramp"], g["max"], g["flat_steps"])

    def params(self) -> list[nn.Parameter]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def seed_from_params(self) -> None:
        """Restart the averages at the current parameter values (history starts over)."""
        for p in self.params():
            self.state[p]["ema"] = p.detach().clone()
        for group in self.param_groups:
            group["updates"] = 0

    @torch.no_grad()
    def step(self, closure: Any = None, *, actor_step: int | None = None) -> None:
        """Torch-optimizer entry point: :meth:`update` with ``actor_step`` (required)."""
        if actor_step is None:
            raise TypeError("EMAOptimizer.step needs actor_step= (the actor's optimizer steps)")
        self.update(actor_step)

    @torch.no_grad()
    def update(self, actor_step: int) -> float:
        """``ema <- d * ema + (1 - d) * actor`` with ``d = decay(actor_step)``; returns ``d``."""
        decay = self.schedule.decay(actor_step)
        emas = [_local(self.state[p]["ema"]) for p in self.params()]
        values = [_local(p.detach()).to(e.dtype) for p, e in zip(self.params(), emas)]
        if emas:
            torch._foreach_lerp_(emas, values, 1.0 - decay)
        for group in self.param_groups:
            group["last_decay"] = decay
            group["updates"] += 1
        return decay

    @contextmanager
    def use_weights(self, model: nn.Module) -> Iterator[None]:
        """Within the block the actor's shards hold the EMA values; restored on exit.

        ``model`` is the FSDP root whose units are resharded before the swap and after the
        restore, so neither side's forward sees the other's gathered weights.
        """
        params = self.params()
        drop_gathered_copies(model)
        with torch.no_grad():
            backup = [_local(p.detach()).clone() for p in params]
            for p in params:
                _local(p.detach()).copy_(_local(self.state[p]["ema"]))
        try:
            yield
        finally:
            drop_gathered_copies(model)
            with torch.no_grad():
                for p, saved in zip(params, backup):
                    _local(p.detach()).copy_(saved)
            del backup


def build_ema(model: nn.Module, args: ParsedArgs) -> EMAOptimizer | None:
    """``--use-ema``: an :class:`EMAOptimizer` over the model's trainable parameters."""
    if not args.use_ema:
        return None
    return EMAOptimizer(model.parameters(), EMASchedule.from_args(args))


def log_ema_reseeded(path: Any) -> None:
    logger.warning(
        "%s has no ema/: EMA is seeded from the loaded actor and its averaging history restarts",
        path,
    )
