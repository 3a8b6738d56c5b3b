"""Megatron checkpoints: torch_dist (model, distributed-optimizer state, LR schedule) inside the
shared ``iter_XXXXXXX/`` layout of :mod:`miles_core.checkpoint_layout`.

The save after rollout ``r`` is iteration ``r + 1``; meta.json records ``next_rollout_id``.
Rank 0 prepares the directory and commits the tracker only after every rank has written.
Model tensors and the distributed-optimizer state (``fully_reshardable``) are
parallelism-agnostic: a TP=2 save resumes at TP=1. A streamed optimizer
(``--stream-optimizer-state-to-disk``) saves its own files next to them
(:mod:`miles_megatron.streamed_optimizer`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from miles_megatron.torch_dist import save_strategy

#: Distributed-optimizer state in megatron-core's fully reshardable form (any TP/PP/DP on load).
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _state(model, optimizer, scheduler, with_optim: bool) -> dict[str, Any]:
    module = model.module if hasattr(model, "module") else model  # DDP -> Float16Module/GPTModel
    model_sd = module.sharded_state_dict()
    state: dict[str, Any] = {"model": model_sd}
    if with_optim:
        from miles_megatron.streamed_optimizer import is_streamed

        if not is_streamed(optimizer):  # streamed state: files of its own, see below
            state["optimizer"] = optimizer.sharded_state_dict(
                model_sd, is_loading=False, metadata=OPTIMIZER_METADATA
            )
        state["opt_param_scheduler"] = scheduler.state_dict()
    return state


def save_checkpoint(
    save_dir: str, rollout_id: int, model, optimizer, scheduler, save_optim: bool, meta_extra: dict
) -> Path:
    """Write iteration ``rollout_id + 1`` and move the tracker to it (collective)."""
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
    state = _state(model, optimizer, scheduler, save_optim)
    dist_checkpointing.save(state, str(target), sharded_strategy=save_strategy(True))
    if save_optim:
        from miles_megatron.streamed_optimizer import save_streamed_state

        save_streamed_state(optimizer, target)  # no-op unless --stream-optimizer-state-to-disk
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


def load_checkpoint(path: Path, model, optimizer, scheduler, load_optim: bool) -> None:
    """Fill model (and optimizer / schedule) from an iteration directory."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    common = load_common_state_dict(str(path)) or {}
    has_optim = "optimizer" in common or any(k.startswith("optimizer") for k in common)
    with_optim = load_optim and has_optim
    state = _state(model, optimizer, scheduler, with_optim=False)
    if with_optim:
        _materialize_optimizer_state(optimizer)
        model_sd = state["model"]
        state["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=True, metadata=OPTIMIZER_METADATA
        )
    loaded = dist_checkpointing.load(state, str(path))
    module = model.module if hasattr(model, "module") else model
    module.load_state_dict(loaded["model"], strict=False)
    if with_optim:
        optimizer.load_state_dict(loaded["optimizer"])
    else:  # 16-bit models: the fp32 master shards were made from the weights before the load
        optimizer.reload_model_params()
    if load_optim:
        from miles_megatron.streamed_optimizer import load_streamed_state

        load_streamed_state(optimizer, path)  # refuses a streamed/in-memory mismatch
    if "opt_param_scheduler" in common:
        scheduler.load_state_dict(common["opt_param_scheduler"])
