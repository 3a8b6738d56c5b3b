"""Megatron checkpoints: torch_dist (model, distributed-optimizer state, LR schedule) inside the
shared ``iter_XXXXXXX/`` layout of :mod:`miles_core.checkpoint_layout`, plus ``rng.pt``.

The save after rollout ``r`` is iteration ``r + 1``; meta.json records ``next_rollout_id``.
Rank 0 prepares the directory and commits the tracker only after every rank has written.
Model tensors and the distributed-optimizer state (``fully_reshardable``) are
parallelism-agnostic: a TP=2 save resumes at TP=1 or PP=2.

``rng.pt`` holds every rank's random states (python, numpy, torch CPU, CUDA and megatron's
CUDA RNG tracker: the TP-aware dropout streams), gathered to rank 0; ``--load`` restores this
rank's entry when the world size is the one saved (``--no-load-rng`` skips it), so a resumed
run draws the same random numbers as one that never stopped.

``--async-save`` uses megatron-core's async machinery: ``dist_checkpointing.save(...,
async_sharded_save=True)`` stages this rank's tensors to host memory and returns a request
whose write runs in a forked process (``AsyncCallsQueue``); the finalisation (megatron's
metadata, then our meta.json and tracker commit) runs on every rank only after every rank's
write finished. Until then the tracker names the previous iteration, so a crash leaves that one
loadable. :func:`finish_saves` waits for what is in flight (the next save and ``close`` call it).

A streamed optimizer (``--stream-optimizer-state-to-disk``) saves its own files next to them,
synchronously (:mod:`miles_megatron.streamed_optimizer`).
"""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.serialization import load_common_state_dict
from miles_core.checkpoint_layout import (
    CheckpointMeta,
    commit_iteration,
    iteration_dir,
    prepare_iteration_dir,
)
from miles_core.safe_load import load_state_file

from miles_megatron import mcore_compat
from miles_megatron.optimizer import distributed_optimizers
from miles_megatron.streamed_optimizer import is_streamed, load_streamed_state, save_streamed_state
from miles_megatron.torch_dist import save_strategy

RNG_FILENAME = "rng.pt"

#: Distributed-optimizer state in megatron-core's fully reshardable form (any TP/PP/DP on load).
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _state(model, optimizer, scheduler, with_optim: bool, model_sd=None) -> dict[str, Any]:
    module = model.module if hasattr(model, "module") else model  # DDP -> Float16Module/GPTModel
    model_sd = module.sharded_state_dict() if model_sd is None else model_sd
    state: dict[str, Any] = {"model": model_sd}
    if with_optim:
        if not is_streamed(optimizer):  # streamed state: files of its own, see save_checkpoint
            state["optimizer"] = optimizer.sharded_state_dict(
                model_sd, is_loading=False, metadata=OPTIMIZER_METADATA
            )
        state["opt_param_scheduler"] = scheduler.state_dict()
    return state


def rng_state() -> dict[str, Any]:
    """This rank's random states (see the module docstring)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if state.get("tracker"):
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _write_rng(target: Path) -> None:
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, rng_state())
    if dist.get_rank() == 0:
        torch.save({"world_size": len(states), "states": states}, target / RNG_FILENAME)


def load_rng(path: Path) -> bool:
    """Restore this rank's random states from ``path/rng.pt``; False when absent or saved at
    another world size (then the seeds of this run stay)."""
    file = path / RNG_FILENAME
    if not file.is_file():
        return False
    saved = load_state_file(file)
    if saved["world_size"] != dist.get_world_size():
        return False
    set_rng_state(saved["states"][dist.get_rank()])
    return True


def _commit(save_dir: str, meta) -> None:
    """Every rank: wait for all writes, then rank 0 writes meta.json and moves the tracker."""
    dist.barrier()
    if dist.get_rank() == 0:
        commit_iteration(save_dir, meta.iteration, meta)
    dist.barrier()


def save_checkpoint(
    save_dir: str,
    rollout_id: int,
    model,
    optimizer,
    scheduler,
    save_optim: bool,
    meta_extra: dict,
    async_queue: Any = None,
    model_sd: dict | None = None,
) -> Path:
    """Write iteration ``rollout_id + 1`` and move the tracker to it (collective).

    With ``async_queue`` (megatron-core ``AsyncCallsQueue``) the tensors are staged and handed
    to a background writer; the tracker moves when :func:`finish_saves` (or the queue's
    non-blocking finalisation) finds every rank's write done. ``model_sd`` replaces the model's
    own sharded state dict (LoRA: the adapters only,
    :func:`miles_megatron.lora.checkpoint.adapter_sharded_state_dict`).
    """
    iteration = rollout_id + 1
    if dist.get_rank() == 0:
        prepare_iteration_dir(save_dir, iteration)
    dist.barrier()
    target = iteration_dir(save_dir, iteration)
    _write_rng(target)
    meta = CheckpointMeta(
        iteration=iteration,
        rollout_id=rollout_id,
        next_rollout_id=rollout_id + 1,
        global_step=int(meta_extra.get("global_step", 0)),
        micro_step=0,
        world_size=dist.get_world_size(),
        backend="megatron",
        extra={k: v for k, v in meta_extra.items() if k != "global_step"},
    )
    state = _state(model, optimizer, scheduler, save_optim, model_sd)
    if save_optim:  # synchronous, so before any tracker commit (also with --async-save)
        save_streamed_state(optimizer, target)  # no-op unless --stream-optimizer-state-to-disk
    if async_queue is None:
        dist_checkpointing.save(state, str(target), sharded_strategy=save_strategy(True))
        _commit(save_dir, meta)
        return target
    request = dist_checkpointing.save(
        state,
        str(target),
        sharded_strategy=save_strategy(False),
        async_sharded_save=True,
        **mcore_compat.async_save_kwargs(),
    )
    request.add_finalize_fn(partial(_commit, save_dir, meta))
    async_queue.schedule_async_request(request)
    return target


def finish_saves(async_queue: Any, blocking: bool = True) -> None:
    """Finalise the async saves whose writes are done (all of them with ``blocking``).

    Collective: every rank calls it at the same point.
    """
    if async_queue is not None and async_queue.get_num_unfinalized_calls():
        async_queue.maybe_finalize_async_calls(blocking=blocking)


def _materialize_optimizer_state(optimizer) -> None:
    """Give a fresh optimizer its Adam state tensors so a checkpoint can be loaded into them.

    megatron-core's torch-Adam path (no TransformerEngine/Apex) creates no ``step`` entry until
    the first step, and ``DistributedOptimizer.state_dict`` needs one; megatron's own
    ``_init_optimizer_states_with_dummy_values`` takes one zero-gradient step, whose values the
    load then overwrites.
    """
    for opt in distributed_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if (
            inner is not None
            and not inner.state
            and hasattr(opt, "_init_optimizer_states_with_dummy_values")
        ):
            opt._init_optimizer_states_with_dummy_values()


def _unshare_adam_steps(optimizer) -> None:
    """Give every parameter's Adam state its own ``step`` tensor.

    megatron-core's ``DistributedOptimizer.load_state_dict`` (torch-Adam path, no TE/Apex) puts
    one ``step`` tensor object into every parameter's state; torch's Adam increments each
    state's ``step`` in place, so the shared counter would advance once per parameter per step
    and the bias correction of a resumed run would differ from the run that never stopped.
    """
    for opt in distributed_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        for state in getattr(inner, "state", {}).values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def load_checkpoint(
    path: Path, model, optimizer, scheduler, load_optim: bool, model_sd: dict | None = None
) -> None:
    """Fill model (and optimizer / schedule) from an iteration directory.

    With ``model_sd`` (a sharded state dict whose tensors' data are parameters, as saved with
    :func:`save_checkpoint`'s ``model_sd``) only those parameters are filled.
    """
    common = load_common_state_dict(str(path)) or {}
    has_optim = "optimizer" in common or any(k.startswith("optimizer") for k in common)
    with_optim = load_optim and has_optim
    state = _state(model, optimizer, scheduler, with_optim=False, model_sd=model_sd)
    targets = {k: v.data for k, v in state["model"].items()} if model_sd is not None else None
    if with_optim:
        _materialize_optimizer_state(optimizer)
        model_sd = state["model"]
        state["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=True, metadata=OPTIMIZER_METADATA
        )
    loaded = dist_checkpointing.load(state, str(path))
    if targets is not None:
        with torch.no_grad():
            for key, param in targets.items():
                param.copy_(loaded["model"][key])
    else:
        module = model.module if hasattr(model, "module") else model
        module.load_state_dict(loaded["model"], strict=False)
    if with_optim:
        optimizer.load_state_dict(loaded["optimizer"])
        _unshare_adam_steps(optimizer)
    else:  # 16-bit models: the fp32 master shards were made from the weights before the load
        optimizer.reload_model_params()
    if load_optim:
        load_streamed_state(optimizer, path)  # refuses a streamed/in-memory mismatch
    if "opt_param_scheduler" in common:
        scheduler.load_state_dict(common["opt_param_scheduler"])
