"""FSDP checkpoints (PyTorch DCP) under the shared iteration layout.

An iteration directory holds::

    iter_XXXXXXX/model/          DCP, sharded model state (master dtype)
    iter_XXXXXXX/optimizer/      DCP, AdamW state           (absent with --no-save-optim)
                                 or, with --stream-optimizer-state-to-disk, the streamed
                                 AdamW's rank*/ bucket files and manifest.json
    iter_XXXXXXX/lr_scheduler/   scheduler state (rank 0)   (absent with --no-save-optim)
    iter_XXXXXXX/ema/            DCP, EMA state              (--use-ema; kept with --no-save-optim)
    iter_XXXXXXX/rng.pt          every rank's RNG states
    iter_XXXXXXX/loss_scale.json the fp16 loss scale's schedule (--fp16 only)
    iter_XXXXXXX/meta.json       counters, written last

The directory of a save after rollout ``r`` is iteration ``r + 1`` (the number of rollouts
trained). Layout, meta.json and commit order come from :mod:`miles_core.checkpoint_layout`:
rank 0 prepares the directory, every rank writes, rank 0 commits (meta.json, fsync, tracker
last). A kill at any point leaves the previously tracked iteration loadable.

Loading: ``--no-load-optim`` skips AdamW state only (a saved scheduler is still restored, so the
LR continues); ``--no-load-rng`` skips ``rng.pt``. Optimizer state is loaded in the format it was
saved in: a streamed checkpoint needs ``--stream-optimizer-state-to-disk`` and a DCP one needs it
off (either mismatch is refused, naming ``--no-load-optim`` as the way to start the optimizer
fresh). EMA (:attr:`Checkpointer.ema`) is saved and loaded whatever the optimizer flags say; a
checkpoint without ``ema/`` seeds it from the loaded actor. With LoRA (``adapter_only``)
``model/`` holds the trainable adapter weights only.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from miles_core.checkpoint_layout import (
    CheckpointMeta,
    commit_iteration,
    prepare_iteration_dir,
    resolve_load,
)
from miles_core.safe_load import load_state_file
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from miles_fsdp.ema import log_ema_reseeded
from miles_fsdp.optimizer import is_streamed


@dataclass
class TrainState:
    """Counters that travel in meta.json."""

    next_rollout_id: int = 0
    global_step: int = 0
    micro_step: int = 0


@dataclass
class PendingSave:
    """An async save whose DCP writes may still be in flight."""

    save_dir: Path
    meta: CheckpointMeta
    futures: list[Future] = field(default_factory=list)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _gather_rng() -> list[dict[str, Any]]:
    mine = _rng_state()
    if not dist.is_initialized():
        return [mine]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def refuse_streamed_checkpoint(optim_dir: Path) -> None:
    """Raise when ``optim_dir`` holds streamed-AdamW state but this run keeps AdamW in memory."""
    if any(optim_dir.glob("rank*/manifest.json")):
        raise ValueError(
            f"{optim_dir}: optimizer state written with --stream-optimizer-state-to-disk; resume "
            "with that flag, or pass --no-load-optim to start the optimizer fresh"
        )


class Checkpointer:
    """Save and load FSDP training state for one rank (all methods are collective)."""

    def __init__(
        self, model: nn.Module, optimizer: Any, scheduler: Any, loss_scaler: Any = None
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.loss_scaler = loss_scaler  # miles_fsdp.loss_scale.LossScaler under --fp16
        self.pending: PendingSave | None = None
        self.async_groups: dict[str, Any] = {}
        self.ema: Any = None  # miles_fsdp.ema.EMAOptimizer under --use-ema
        self.adapter_only = False  # LoRA: model/ holds the trainable (adapter) weights only

    def _model_options(self) -> StateDictOptions:
        return StateDictOptions(
            ignore_frozen_params=self.adapter_only, strict=not self.adapter_only
        )

    def _async_group(self, name: str) -> Any:
        """A dedicated gloo group per async writer (created collectively, on first use)."""
        if not dist.is_initialized():
            return None
        if name not in self.async_groups:
            self.async_groups[name] = dist.new_group(backend="gloo")
        return self.async_groups[name]

    # ----------------------------------------------------------------------- save
    def save(
        self,
        save_dir: str | os.PathLike,
        rollout_id: int,
        state: TrainState,
        save_optim: bool = True,
        async_save: bool = False,
    ) -> None:
        """Write iteration ``rollout_id``; with ``async_save`` only the staging happens now.

        The tracker moves to this iteration when the save completes (at once when synchronous,
        at the next :meth:`finalize` otherwise).
        """
        self.finalize()
        save_dir = Path(save_dir)
        iteration = rollout_id + 1
        if _rank() == 0:
            target = prepare_iteration_dir(save_dir, iteration)
        _barrier()
        target = save_dir / f"iter_{iteration:07d}"
        writes = {
            "model": {"model": get_model_state_dict(self.model, options=self._model_options())}
        }
        streamed = is_streamed(self.optimizer)
        if save_optim and streamed:  # every rank copies its bucket files (synchronous)
            self.optimizer.save(str(target / "optimizer"))
        elif save_optim:
            writes["optimizer"] = {
                "optimizer": get_optimizer_state_dict(self.model, self.optimizer)
            }
        if self.ema is not None:
            writes["ema"] = {"ema": get_optimizer_state_dict(self.model, self.ema)}
        futures = []
        for sub, sd in writes.items():
            if async_save:
                # Each background writer gets its own gloo group: its collectives must not
                # interleave with the training loop's or with the other writer's.
                futures.append(
                    dcp.async_save(
                        sd, checkpoint_id=str(target / sub), process_group=self._async_group(sub)
                    )
                )
            else:
                dcp.save(sd, checkpoint_id=str(target / sub))
        rng = _gather_rng()
        if _rank() == 0:
            torch.save({"world_size": len(rng), "states": rng}, target / "rng.pt")
            if self.loss_scaler is not None:
                self.loss_scaler.save(target)
            if save_optim:
                (target / "lr_scheduler").mkdir()
                torch.save(self.scheduler.state_dict(), target / "lr_scheduler" / "state.pt")
        meta = CheckpointMeta(
            iteration=iteration,
            rollout_id=rollout_id,
            next_rollout_id=state.next_rollout_id,
            global_step=state.global_step,
            micro_step=state.micro_step,
            world_size=len(rng),
            backend="fsdp",
            extra={
                "has_optimizer": save_optim,
                "optimizer_format": "streamed" if streamed else "dcp",
            },
        )
        self.pending = PendingSave(save_dir, meta, futures)
        if not async_save:
            self.finalize()

    def finalize(self) -> None:
        """Wait for the pending save, publish it (meta.json, rename, tracker). Collective."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        for fut in pending.futures:
            fut.result()
        _barrier()
        if _rank() == 0:
            commit_iteration(pending.save_dir, pending.meta.iteration, pending.meta)
        _barrier()

    # ----------------------------------------------------------------------- load
    def load(
        self,
        load_dir: str | os.PathLike,
        load_optim: bool = True,
        load_rng: bool = True,
        ckpt_step: int | None = None,
    ) -> TrainState | None:
        """Restore the tracked iteration of ``load_dir`` (or ``ckpt_step``, ``--ckpt-step``).

        Returns ``None`` when ``load_dir`` holds no tracked iteration and no step is asked for;
        errors about the directory, tracker or meta.json come from ``resolve_load``.
        """
        resolved = resolve_load(load_dir, ckpt_step)
        if resolved is None:
            return None
        iter_dir, meta = resolved.path, resolved.meta
        options = self._model_options()
        model_sd = {"model": get_model_state_dict(self.model, options=options)}
        dcp.load(model_sd, checkpoint_id=str(iter_dir / "model"))
        set_model_state_dict(self.model, model_sd["model"], options=options)
        if self.ema is not None:
            if (iter_dir / "ema").is_dir():
                ema_sd = {"ema": get_optimizer_state_dict(self.model, self.ema)}
                dcp.load(ema_sd, checkpoint_id=str(iter_dir / "ema"))
                set_optimizer_state_dict(self.model, self.ema, ema_sd["ema"])
            else:
                self.ema.seed_from_params()
                log_ema_reseeded(iter_dir)
        if load_optim and (iter_dir / "optimizer").is_dir() and is_streamed(self.optimizer):
            self.optimizer.load(str(iter_dir / "optimizer"))  # refuses a DCP checkpoint
        elif load_optim and (iter_dir / "optimizer").is_dir():
            refuse_streamed_checkpoint(iter_dir / "optimizer")
            optim_sd = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
            dcp.load(optim_sd, checkpoint_id=str(iter_dir / "optimizer"))
            set_optimizer_state_dict(
                self.model, self.optimizer, optim_sd["optimizer"], options=StateDictOptions()
            )
        scheduler_file = iter_dir / "lr_scheduler" / "state.pt"
        if scheduler_file.exists():
            self.scheduler.load_state_dict(load_state_file(scheduler_file))
            # A fresh optimizer (--no-load-optim) still carries the initial LR: apply the
            # restored schedule's current value so the LR continues where it stopped.
            for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
                group["lr"] = lr
        if self.loss_scaler is not None:
            self.loss_scaler.load(iter_dir)
        if load_rng:
            rng = load_state_file(iter_dir / "rng.pt")
            if rng["world_size"] == (dist.get_world_size() if dist.is_initialized() else 1):
                _set_rng_state(rng["states"][_rank()])
        return TrainState(
            next_rollout_id=meta.next_rollout_id,
            global_step=meta.global_step,
            micro_step=meta.micro_step,
        )


# --------------------------------------------------------------------------- HF export
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def export_hf(
    weights: Any,
    hf_source: str | os.PathLike,
    out_dir: str | os.PathLike,
    max_shard_bytes: int = 4 << 30,
) -> None:
    """Write a HF directory: safetensors in checkpoint names and dtypes, plus config/tokenizer.

    ``weights`` yields ``(hf_name, tensor)`` (a :class:`~miles_fsdp.publish_source.WeightSource`);
    it is consumed on every rank (gathering is collective) and rank 0 writes. Each shard is
    written as soon as it holds ``max_shard_bytes``, so rank 0 keeps at most one shard in host
    memory; with more than one shard they are renamed ``model-0000i-of-0000n.safetensors`` and an
    index is written. Every non-weight file of ``hf_source`` (config.json,
    generation_config.json, tokenizer files, custom code) is copied verbatim.
    """
    out_dir = Path(out_dir)
    write = _rank() == 0
    if write:
        out_dir.mkdir(parents=True, exist_ok=True)
    written: list[tuple[Path, list[str], int]] = []
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        path = out_dir / f".export-shard-{len(written):05d}.safetensors"
        save_file(shard, str(path), metadata={"format": "pt"})
        written.append((path, list(shard), size))

    for name, tensor in weights:
        if not write:
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
            shard, size = {}, 0
        shard[name] = tensor.detach().cpu().contiguous()
        size += nbytes
    if write:
        if shard or not written:
            flush()
        shard = {}
        if len(written) == 1:
            os.replace(written[0][0], out_dir / "model.safetensors")
        else:
            weight_map, total = {}, 0
            for i, (path, names, nbytes) in enumerate(written):
                file_name = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
                os.replace(path, out_dir / file_name)
                weight_map.update(dict.fromkeys(names, file_name))
                total += nbytes
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        for src in Path(hf_source).iterdir():
            if (
                src.is_file()
                and not src.name.endswith(WEIGHT_SUFFIXES)
                and src.name not in WEIGHT_INDEXES
            ):
                shutil.copy2(src, out_dir / src.name)
    _barrier()
