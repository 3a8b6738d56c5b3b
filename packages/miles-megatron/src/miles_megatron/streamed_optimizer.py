"""``--stream-optimizer-state-to-disk`` in megatron-core's distributed optimizer.

megatron's ``DistributedOptimizer`` steps an inner ``torch.optim.AdamW`` over this rank's
*main-parameter shards* (fp32; views of the fp32 parameters, or fp32 copies of 16-bit ones),
after reduce-scattering the gradients into their ``.grad`` and clipping them, and then copies
the shards into the parameter buffer and all-gathers it over DP. :func:`stream_optimizer_state`
swaps that inner AdamW for miles-offload's :class:`~miles_offload.streamed_adam.StreamedAdamW`
over the *same* shard tensors and parameter groups (so the LR schedule, weight-decay
multipliers, gradient clipping and the copy/all-gather stay megatron's): the fp32 masters and
both Adam moments live in bucket files under ``--offload-train-disk-dir`` and are streamed
through the step. The update is torch's functional AdamW with the kernel choice megatron's
AdamW makes (``foreach``/``fused`` left to torch), so with ``--stream-optimizer-state-moment-dtype
fp32`` the result is bit-identical to megatron's in-memory optimizer.

16-bit models: megatron's fp32 master shards are device tensors. Their storage is released
after every step's copy into the parameter buffer and re-grown (uninitialised) before the
next update, which overwrites them from the streamed masters; between steps the device holds
no fp32 master. Every shard of a 16-bit model is streamed (``--stream-optimizer-min-numel``
applies to fp32 models only), so every master is in the files and in checkpoints.

Names: each shard is ``<parameter name>[<start>:<end>]`` (the range of the TP-local parameter,
flattened, that this DP rank owns). Checkpoints: every rank saves its own
``StreamedAdamW`` checkpoint under ``<iteration dir>/streamed_optimizer/rank<R>/`` (manifest,
bucket files, small-parameter state); resuming needs the same TP/PP/EP/DP layout and refuses
another one, or a checkpoint written without streaming, with a message (``--no-load-optim``
starts the optimizer fresh).
"""

from __future__ import annotations

import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from miles_core.args import ArgumentError
from miles_core.optimizer import OptimizerConfig
from miles_offload.streamed_adam import StreamedAdamConfig, StreamedAdamW

from miles_megatron.optimizer import distributed_optimizers

STATE_DIR = "streamed_optimizer"


class StreamedDistributedOptimizer(DistributedOptimizer):
    """megatron's distributed optimizer with a :class:`StreamedAdamW` as its inner optimizer.

    Made by :func:`stream_optimizer_state` from a built ``DistributedOptimizer`` (its class is
    switched; it adds no state of its own besides ``_released``). Its state is checkpointed
    with :func:`save_streamed_state` / :func:`load_streamed_state`, not megatron's state dicts.
    """

    _released: list[tuple[torch.Tensor, int]]  # (16-bit model's fp32 master shard, bytes)

    def step_with_ready_grads(self) -> bool:
        for shard, nbytes in self._released:
            shard.untyped_storage().resize_(nbytes)  # overwritten by the update's masters
        return super().step_with_ready_grads()

    def _copy_main_params_to_model_params(self) -> None:
        super()._copy_main_params_to_model_params()
        for shard, _ in self._released:
            shard.untyped_storage().resize_(0)

    def state_dict(self):
        raise RuntimeError(
            "--stream-optimizer-state-to-disk: the optimizer state lives in files; it is "
            "checkpointed by miles_megatron.streamed_optimizer.save_streamed_state"
        )

    def sharded_state_dict(self, *args: Any, **kwargs: Any):
        return self.state_dict()

    def load_state_dict(self, state_dict):
        return self.state_dict()

    @property
    def streamed(self) -> StreamedAdamW:
        return self.optimizer


def _shard_names(opt: DistributedOptimizer) -> dict[int, str]:
    """``id(main shard) -> "<param name>[start:end]"`` for every main-parameter shard."""
    names = {}
    pairs = [
        (opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
        (opt.model_fp32_groups, opt.shard_fp32_groups),
    ]
    for model_groups, shard_groups in pairs:
        for model_group, shard_group in zip(model_groups, shard_groups):
            for model_param, shard in zip(model_group, shard_group):
                r = opt._get_model_param_range_map(model_param)["param"]
                names[id(shard)] = f"{opt._param_name(model_param)}[{r.start}:{r.end}]"
    return names


def _make_fp32_shards_leaves(opt: DistributedOptimizer) -> None:
    """Replace each fp32 parameter's main shard (a view of the parameter, so not a leaf, which
    ``torch.optim.Optimizer`` refuses) by a detached view of the same memory, everywhere
    megatron holds it (its shard lists and the inner optimizer's groups), with the same
    tensor-parallel attributes. megatron itself sidesteps the check by editing the inner
    optimizer's groups after building it."""
    replaced: dict[int, torch.Tensor] = {}
    for model_group, shard_group in zip(opt.model_fp32_groups, opt.shard_fp32_groups):
        for i, (model_param, shard) in enumerate(zip(model_group, shard_group)):
            if shard.is_leaf:
                continue
            leaf = shard.detach()
            tensor_parallel.copy_tensor_model_parallel_attributes(leaf, model_param)
            if hasattr(model_param, "shared"):
                leaf.shared = model_param.shared
            shard_group[i] = replaced[id(shard)] = leaf
    for group in opt.optimizer.param_groups:
        group["params"] = [replaced.get(id(p), p) for p in group["params"]]


def stream_optimizer_state(optimizer, cfg: OptimizerConfig) -> None:
    """Give every distributed optimizer in ``optimizer`` a streamed inner AdamW (in place).

    The files' settings are ``cfg.streamed`` (``--offload-train-disk-dir``,
    ``--stream-optimizer-state-moment-dtype``, ``--stream-optimizer-bucket-numel``,
    ``--stream-optimizer-min-numel``), the AdamW hyperparameters ``cfg``'s.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    for i, opt in enumerate(distributed_optimizers(optimizer)):
        if not isinstance(opt, DistributedOptimizer) or opt.is_stub_optimizer:
            continue
        inner = opt.optimizer
        if not isinstance(inner, torch.optim.AdamW):
            raise ArgumentError(
                "--stream-optimizer-state-to-disk replaces megatron's torch AdamW; this build "
                f"uses {type(inner).__name__} (TransformerEngine/Apex FusedAdam or CPU offload)"
            )
        _make_fp32_shards_leaves(opt)
        names = _shard_names(opt)
        sixteen_bit = {id(s) for g in opt.shard_fp32_from_float16_groups for s in g}
        groups = []
        for group in inner.param_groups:
            keys = {k: v for k, v in group.items() if k not in ("params", "param_names")}
            params = list(group["params"])
            groups.append({**keys, "params": params, "param_names": [names[id(p)] for p in params]})
        settings = cfg.streamed
        if sixteen_bit:
            settings = replace(settings, min_numel=0)
        config = StreamedAdamConfig(
            **asdict(settings),
            name=f"megatron{i}-rank{rank}",
            rank=0,
            world_size=1,  # each rank owns different shards: one checkpoint per rank
        )
        streamed = StreamedAdamW(
            groups,
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            config=config,
        )
        opt.optimizer = streamed
        opt.__class__ = StreamedDistributedOptimizer
        opt._released = [
            (p, p.untyped_storage().nbytes())
            for p, _, _ in streamed._streamed
            if id(p) in sixteen_bit and p.numel() > 0
        ]


def is_streamed(optimizer) -> bool:
    return any(
        isinstance(o, StreamedDistributedOptimizer) for o in distributed_optimizers(optimizer)
    )


def _streamed(optimizer) -> list[StreamedAdamW]:
    return [
        o.streamed
        for o in distributed_optimizers(optimizer)
        if isinstance(o, StreamedDistributedOptimizer)
    ]


def _rank_dir(iteration_dir: Path, index: int) -> str:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return os.path.join(iteration_dir, STATE_DIR, f"rank{rank:05d}", f"optimizer{index}")


def save_streamed_state(optimizer, iteration_dir: Path) -> None:
    """Every rank: its streamed optimizers' checkpoints under ``streamed_optimizer/rank<R>/``."""
    for index, streamed in enumerate(_streamed(optimizer)):
        streamed.save(_rank_dir(iteration_dir, index))


def load_streamed_state(optimizer, iteration_dir: Path) -> None:
    """Resume the streamed state; refuse a checkpoint of another layout or without it.

    Also refuses to load a streamed checkpoint into an in-memory optimizer (its state would be
    silently missing).
    """
    state_dir = Path(iteration_dir) / STATE_DIR
    if not is_streamed(optimizer):
        if state_dir.exists():
            raise ValueError(
                f"{iteration_dir}: the optimizer state was saved with "
                "--stream-optimizer-state-to-disk; resume with it (or pass --no-load-optim)"
            )
        return
    if not state_dir.exists():
        raise ValueError(
            f"{iteration_dir}: no streamed optimizer state ({STATE_DIR}/); this checkpoint was "
            "written without --stream-optimizer-state-to-disk. Pass --no-load-optim to start "
            "the optimizer fresh from the loaded weights"
        )
    world = dist.get_world_size() if dist.is_initialized() else 1
    saved = len([d for d in os.listdir(state_dir) if d.startswith("rank")])
    if saved != world:
        raise ValueError(
            f"{state_dir}: saved by {saved} ranks, resumed on {world}; the megatron backend's "
            "streamed optimizer state resumes on the same parallel layout only (or pass "
            "--no-load-optim)"
        )
    for index, streamed in enumerate(_streamed(optimizer)):
        streamed.load(_rank_dir(iteration_dir, index))


def close_streamed(optimizer) -> None:
    """Remove the working bucket files."""
    for streamed in _streamed(optimizer):
        streamed.close()
