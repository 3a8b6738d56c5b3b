"""DDP wrapper, megatron-core's distributed optimizer and the LR schedule from the shared flags.

The distributed optimizer is always on: fp32 master weights and Adam moments are sharded over
the data-parallel ranks (``use_distributed_optimizer=True``), gradients are reduce-scattered
from the DDP buffers into them and the updated parameters all-gathered back.

Flag mapping (miles-core's optimizer group -> ``OptimizerConfig``): ``--lr`` -> ``lr``,
``--min-lr`` -> ``min_lr``, ``--weight-decay``, ``--adam-beta1/2``, ``--adam-eps``,
``--clip-grad`` (0 disables clipping), ``--bf16``/``--fp16``, ``--optimizer-cpu-offload``
(megatron-core's ``HybridDeviceOptimizer``; ``optimizer_offload_fraction`` 1.0 unless
``--optimizer-offload-fraction`` is given, as in Megatron-LM); generated ``OptimizerConfig`` /
``DistributedDataParallelConfig`` flags apply on top (``--overlap-cpu-optimizer-d2h-h2d``,
``--use-precision-aware-optimizer``, ...). ``--stream-optimizer-state-to-disk`` swaps the inner
AdamW for miles-offload's streamed one (:mod:`miles_megatron.streamed_optimizer`). The LR
schedule is megatron-core's ``OptimizerParamScheduler`` with ``--lr-warmup-iters``,
``--lr-decay-iters`` (unset: constant after warm-up) and ``--lr-decay-style``.
"""

from __future__ import annotations

from typing import Any

import torch

from miles_megatron.model_config import params_dtype


def wrap_ddp(model: torch.nn.Module, config: Any, args: Any) -> torch.nn.Module:
    """megatron-core DDP over ``model`` with contiguous grad buffers for the distributed optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from miles_megatron.generated_flags import config_overrides

    kwargs: dict[str, Any] = dict(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False
    )
    kwargs.update(config_overrides(args, DistributedDataParallelConfig))
    return DistributedDataParallel(config, DistributedDataParallelConfig(**kwargs), model)


def distributed_optimizers(optimizer: Any) -> list:
    """The distributed optimizers of this model: the parts of megatron-core's
    ``ChainedOptimizer`` (one for the dense parameters, one for the expert parameters of an MoE),
    or ``optimizer`` itself when it is not chained."""
    return [o for o in getattr(optimizer, "chained_optimizers", [optimizer]) if o is not None]


def optimizer_config(args: Any):
    """megatron-core's ``OptimizerConfig`` from the flags (see the module docstring)."""
    from megatron.core.optimizer import OptimizerConfig

    from miles_megatron.generated_flags import config_overrides

    dtype = params_dtype(args)
    kwargs: dict[str, Any] = dict(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=True,
        optimizer_cpu_offload=bool(getattr(args, "optimizer_cpu_offload", False)),
        # fp16 loss scaling: miles-core's flags, Megatron-LM's names and meanings
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
    )
    if kwargs["optimizer_cpu_offload"]:
        kwargs["optimizer_offload_fraction"] = 1.0  # Megatron-LM's default; core's is 0
    kwargs.update(config_overrides(args, OptimizerConfig))
    return OptimizerConfig(**kwargs)


def build_optimizer(model: torch.nn.Module, args: Any):
    """``(optimizer, scheduler)`` for the DDP-wrapped ``model``."""
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = get_megatron_optimizer(optimizer_config(args), [model])
    if getattr(args, "stream_optimizer_state_to_disk", False):
        from miles_megatron.streamed_optimizer import stream_optimizer_state

        stream_optimizer_state(optimizer, args)
    decay_iters = args.lr_decay_iters or 0
    warmup = args.lr_warmup_iters
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup else args.lr,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(decay_iters, warmup + 1),
        lr_decay_style=args.lr_decay_style if decay_iters else "constant",
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=max(decay_iters, 1),
        wd_incr_style="constant",
    )
    return optimizer, scheduler
