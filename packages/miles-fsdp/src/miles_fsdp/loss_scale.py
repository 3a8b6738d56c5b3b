"""fp16 loss scaling for the FSDP backend, with Megatron-LM's flags and semantics.

With ``--fp16`` every micro-batch's loss is multiplied by the current scale ``S`` before
``backward`` so small gradients survive fp16; the gradients are divided by ``S`` before clipping
and the optimizer step. A step whose (unscaled) gradient norm is not finite is skipped.

Dynamic scaling (``--loss-scale`` unset), starting at ``--initial-loss-scale``::

    overflow:  hysteresis_left -= 1;  if hysteresis_left <= 0: S = max(S / 2, --min-loss-scale)
               good_steps = 0
    finite:    good_steps += 1;  if good_steps == --loss-scale-window:
                   S = 2 S;  good_steps = 0;  hysteresis_left = --hysteresis

``--loss-scale X`` fixes ``S = X`` (overflowing steps are still skipped). bf16 and fp32 runs
have no scaler. The state is saved with the checkpoint (``loss_scale.json``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from miles_core.args.parsed import ParsedArgs
from torch import nn

FILE_NAME = "loss_scale.json"


@dataclass
class LossScaler:
    scale: float
    dynamic: bool = True
    min_scale: float = 1.0
    window: int = 1000
    hysteresis: int = 2
    good_steps: int = 0
    hysteresis_left: int = 2

    @classmethod
    def from_args(cls, args: ParsedArgs) -> LossScaler | None:
        """The scaler ``--fp16`` asks for; None for bf16 / fp32."""
        if not args.fp16:
            return None
        if args.loss_scale is not None:
            return cls(scale=float(args.loss_scale), dynamic=False)
        return cls(
            scale=float(args.initial_loss_scale),
            min_scale=float(args.min_loss_scale),
            window=int(args.loss_scale_window),
            hysteresis=int(args.hysteresis),
            hysteresis_left=int(args.hysteresis),
        )

    def unscale_(self, model: nn.Module) -> None:
        """Divide every gradient by the scale, in place (local shards of DTensor gradients)."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:
            return
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        torch._foreach_mul_(local, 1.0 / self.scale)

    def update(self, found_inf: bool) -> None:
        """Advance the schedule after a step (module docstring)."""
        if not self.dynamic:
            return
        if found_inf:
            self.good_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
            return
        self.good_steps += 1
        if self.good_steps == self.window:
            self.scale *= 2.0
            self.good_steps = 0
            self.hysteresis_left = self.hysteresis

    def save(self, iter_dir: Path) -> None:
        (Path(iter_dir) / FILE_NAME).write_text(json.dumps(asdict(self)))

    def load(self, iter_dir: Path) -> bool:
        """Restore a dynamic schedule (scale, counters) saved with the checkpoint; returns
        whether one was restored. A ``--loss-scale`` given now keeps its fixed value."""
        path = Path(iter_dir) / FILE_NAME
        if not self.dynamic or not path.exists():
            return False
        saved = json.loads(path.read_text())
        self.scale = float(saved["scale"])
        self.good_steps = int(saved["good_steps"])
        self.hysteresis_left = int(saved["hysteresis_left"])
        return True
