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
AdamW for miles-offload's streamed one (:mod:`miles_megatron.streamed_optimizer`).

The hyperparameters and the LR schedule are miles-core's (:mod:`miles_core.optimizer`, shared
with the FSDP backend): :class:`CoreLRScheduler` is megatron-core's ``OptimizerParamScheduler``
(its checkpoint entry and weight-decay handling) with ``get_lr`` replaced by
``OptimizerConfig.lr_at``, so the LR of every step is the FSDP backend's. The flags win over a
resumed checkpoint's schedule values, as under FSDP.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from miles_core.args.parsed import ParsedArgs
from miles_core.optimizer import OptimizerConfig, run_optimizer_steps
from miles_core.optimizer import optimizer_config as core_optimizer_config

from miles_megatron.generated_flags import config_overrides
from miles_megatron.model_config import params_dtype


def wrap_ddp(model: torch.nn.Module, config: Any, args: ParsedArgs) -> torch.nn.Module:
    """megatron-core DDP over ``model`` with contiguous grad buffers for the distributed optimizer."""
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


def _core_config(args: ParsedArgs) -> OptimizerConfig:
    """miles-core's optimizer settings of the parsed groups (the critic's under critic_args)."""
    cfg = args.run_config
    return core_optimizer_config(cfg.optimizer, cfg.offload, run_optimizer_steps(args))


def optimizer_config(args: ParsedArgs):
    """megatron-core's ``OptimizerConfig`` from the flags (see the module docstring)."""
    dtype = params_dtype(args)
    core = _core_config(args)
    kwargs: dict[str, Any] = dict(
        optimizer="adam",
        lr=core.lr,
        min_lr=core.min_lr,
        weight_decay=core.weight_decay,
        adam_beta1=core.adam_beta1,
        adam_beta2=core.adam_beta2,
        adam_eps=core.adam_eps,
        clip_grad=core.clip_grad,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=True,
        optimizer_cpu_offload=args.optimizer_cpu_offload,
        # fp16 loss scaling: miles-core's flags, Megatron-LM's names and meanings
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
    )
    if kwargs["optimizer_cpu_offload"]:
        kwargs["optimizer_offload_fraction"] = 1.0  # Megatron-LM's default; core's is 0
    kwargs.update(config_overrides(args, MegatronOptimizerConfig))
    return MegatronOptimizerConfig(**kwargs)


class CoreLRScheduler(OptimizerParamScheduler):
    """megatron-core's scheduler whose LR is miles-core's schedule (``cfg.lr_at``) of its step
    count; a parameter group's own ``max_lr`` / ``min_lr`` replace the peak and floor."""

    def __init__(self, optimizer: Any, cfg: OptimizerConfig) -> None:
        self.cfg = cfg
        warmup = cfg.lr_warmup_iters
        super().__init__(
            optimizer,
            init_lr=0.0,
            max_lr=cfg.lr,
            min_lr=cfg.min_lr,
            lr_warmup_steps=warmup,
            lr_decay_steps=max(cfg.lr_decay_iters or 1, warmup + 1),
            lr_decay_style=cfg.lr_decay_style,
            start_wd=cfg.weight_decay,
            end_wd=cfg.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
            use_checkpoint_opt_param_scheduler=False,
            override_opt_param_scheduler=True,
        )

    def get_lr(self, param_group: dict) -> float:
        return self.cfg.lr_at(
            self.num_steps,
            lr=param_group.get("max_lr", self.cfg.lr),
            min_lr=param_group.get("min_lr", self.cfg.min_lr),
        )


def build_scheduler(optimizer: Any, cfg: OptimizerConfig) -> CoreLRScheduler:
    """The LR schedule of ``optimizer`` (megatron's, or anything with ``param_groups``)."""
    return CoreLRScheduler(optimizer, cfg)


def build_optimizer(model: torch.nn.Module, args: ParsedArgs):
    """``(optimizer, scheduler)`` for the DDP-wrapped ``model``."""
    core = _core_config(args)
    optimizer = get_megatron_optimizer(optimizer_config(args), [model])
    if core.streamed is not None:
        # cycle: miles_megatron.streamed_optimizer imports this module
        from miles_megatron.streamed_optimizer import stream_optimizer_state

        stream_optimizer_state(optimizer, core)
    return optimizer, build_scheduler(optimizer, core)
