"""Megatron checkpoints: torch_dist (model, distributed-optimizer state, LR schedule) inside the
shared ``iter_XXXXXXX/`` layout of :mod:`miles_core.checkpoint_layout`.

The save after rollout ``r`` is iteration ``r + 1``; meta.json records ``next_rollout_id``.
Rank 0 prepares the directory and commits the tracker only after every rank has written.
Model tensors and the distributed-optimizer state (``fully_reshardable``) are
parallelism-agnostic: a TP=2 save resumes at TP=1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles_megatron.torch_dist import save_strategy

#: Distributed-optimizer state in megatron-core's fully reshardable form (any TP/PP/DP on load).
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _state(model, optimizer, scheduler, with_optim: bool, model_sd=None) -> dict[str, Any]:
    module = model.module if hasattr(model, "module") else model  # DDP -> Float16Module/GPTModel
    model_sd = module.sharded_state_dict() if model_sd is None else model_sd
    state: dict[str, Any] = {"model": model_sd}
    if with_optim:
        state["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=False, metadata=OPTIMIZER_METADATA
        )
        state["opt_param_scheduler"] = scheduler.state_dict()
    return state


def save_checkpoint(
    save_dir: str,
    rollout_id: int,
    model,
    optimizer,
    scheduler,
    save_optim: bool,
    meta_extra: dict,
    model_sd: dict | None = None,
) -> Path:
    """Write iteration ``rollout_id + 1`` and move the tracker to it (collective).

    ``model_sd`` replaces the model's own sharded state dict (LoRA: the adapters only,
    :func:`miles_megatron.lora.checkpoint.adapter_sharded_state_dict`).
    """
    from megatron.core import dist_checkpointing
    from miles_core.checkpoint_layout import (
        CheckpointMeta,
        commit_iteration,
        iteration_dir,
        prepare_iteration_dir,
    )

    iteration = rollout_id + 1
    if dist.get_rank() == 0:
        prepare_iteration_dir(save_dir, iteration)
    dist.barrier()
    target = iteration_dir(save_dir, iteration)
    state = _state(model, optimizer, scheduler, save_optim, model_sd)
    dist_checkpointing.save(state, str(target), sharded_strategy=save_strategy(True))
    dist.barrier()
    if dist.get_rank() == 0:
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
        commit_iteration(save_dir, iteration, meta)
    dist.barrier()
    return target


def _materialize_optimizer_state(optimizer) -> None:
    """Give a fresh optimizer its Adam state tensors so a checkpoint can be loaded into them.

    megatron-core's torch-Adam path (no TransformerEngine/Apex) creates no ``step`` entry until
    the first step, and ``DistributedOptimizer.state_dict`` needs one; megatron's own
    ``_init_optimizer_states_with_dummy_values`` takes one zero-gradient step, whose values the
    load then overwrites.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if (
            inner is not None
            and not inner.state
            and hasattr(opt, "_init_optimizer_states_with_dummy_values")
        ):
            opt._init_optimizer_states_with_dummy_values()


def load_checkpoint(
    path: Path, model, optimizer, scheduler, load_optim: bool, model_sd: dict | None = None
) -> None:
    """Fill model (and optimizer / schedule) from an iteration directory.

    With ``model_sd`` (a sharded state dict whose tensors' data are parameters, as saved with
    :func:`save_checkpoint`'s ``model_sd``) only those parameters are filled.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

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
    else:
        optimizer.reload_model_params()  # the fp32 main copies follow the loaded weights
    if "opt_param_scheduler" in common:
        scheduler.load_state_dict(common["opt_param_scheduler"])
