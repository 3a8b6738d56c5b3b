"""One rollout's optimizer steps on megatron-core: DDP grad buffers + the distributed optimizer.

Loss scaling is miles-core's (docs/rl-math.md): each micro-batch's loss is its contribution
``sum(token losses) / D`` with the step's global denominator ``D``; megatron-core's DDP divides
the reduced gradients by the data-parallel size, so each rank back-propagates
``dp_size * contribution`` and the reduced gradient is exactly ``dL/dw`` for any split.
TP peers compute identical log-probs and losses (the fused vocabulary-parallel head, or the
vocabulary-gathered logits under ``--no-fused-log-probs``); CP ranks compute the terms of their
own tokens (:mod:`miles_megatron.context_parallel`), shares that add up; metrics are combined
over the data-parallel x context-parallel group (summed; extremes by maximum or minimum, and
per-sample values first summed over the CP group: :mod:`miles_core.metric_reduction`). At
PP > 1 the micro-batches run megatron's 1F1B schedule (:mod:`miles_megatron.schedule`): the
loss and metrics exist on the last stage, which broadcasts the metrics to the other stages.

``--kl-coef`` (KL in the reward, ``reinforce_plus_plus*`` / ``ppo`` estimators): the token
rewards get ``-kl_coef * kl_t`` with ``kl_t = kl_estimate(old, ref, --kl-loss-type)`` from the
policy's log-probs before the rollout's updates and the reference's (``--ref-load``).

The critic (``--use-critic``, ``--loss-type value_loss``) takes the same steps with the value
head's scores (:mod:`miles_megatron.value_head`) and miles-core's clipped value loss
(:func:`~miles_core.losses.compute_value_loss`) against the GAE returns of its own ``values``
(computed by :meth:`MegatronBackend.compute_values` before the update); it reads no old or
reference log-probs.

A ``--custom-loss-function-path`` hook (miles-core's :mod:`~miles_core.custom_loss`, the FSDP
backend's signature and checks) replaces the actor's loss on the last stage: it gets the
micro-batch's packed row, its ``[1, T, V]`` logits (gathered over TP) or its fused
:class:`~miles_core.custom_loss.TokenScores`, the step's ``LossConfig`` and denominator, and its
contribution is back-propagated like the built-in loss's. Its context carries no roles.
CP > 1 is refused at argument time (the hook sees whole rows).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.distributed import finalize_model_grads
from miles_core import mismatch, old_policy
from miles_core.advantages import with_advantages
from miles_core.aggregation import loss_denominator
from miles_core.args.parsed import ParsedArgs
from miles_core.batch import RolloutBatch
from miles_core.custom_loss import LossHook, LossHookContext, TokenScores
from miles_core.losses import (
    LossConfig,
    entropy_needs_grad,
    packed_score_loss,
    packed_value_loss,
)
from miles_core.metric_reduction import StepMetrics, over_steps
from miles_core.micro_batch import MicroBatching, split_steps
from miles_core.micro_batch import split_micro_batches as split_for_ranks
from miles_core.packing import pack_thd
from miles_core.rollout_correction import with_batch_mean

from miles_megatron.context_parallel import PackedShard, row_pad_multiple
from miles_megatron.output_head import LogitsHead, ScoreHead
from miles_megatron.packed_forward import rollout_log_probs
from miles_megatron.schedule import broadcast_from_last_stage, run_schedule
from miles_megatron.value_head import ValueScores


@dataclass
class TrainContext:
    """What a rollout's training needs from the backend."""

    model: torch.nn.Module  # the DDP-wrapped GPTModel
    optimizer: Any  # megatron-core DistributedOptimizer (or ChainedOptimizer)
    scheduler: Any  # OptimizerParamScheduler
    args: ParsedArgs
    device: torch.device
    vocab_size: int
    dp_size: int
    dp_group_gloo: Any
    cp_size: int
    dp_cp_group_gloo: Any  # metrics are combined over it (the DP group at CP = 1)
    cp_group: Any = None  # the CP group at CP > 1: per-sample metrics are summed over it
    before_log_prob_hook: Any = None
    before_train_step_hook: Any = None
    loss_hook: LossHook | None = None  # --custom-loss-function-path (the actor's)


def split_micro_batches(ctx: TrainContext, batch: RolloutBatch) -> list[RolloutBatch]:
    """This rank's micro-batches, as many as the busiest DP rank needs; the token budget of
    one is ``--max-tokens-per-gpu x --context-parallel-size`` (the CP group shares it)."""
    how = MicroBatching.from_algorithm(ctx.args.run_config.algorithm, cp_size=ctx.cp_size)
    return split_for_ranks(batch, how, group=ctx.dp_group_gloo)


def optimizer_step(
    ctx: TrainContext, step_batch: RolloutBatch, config: LossConfig, detach_old: bool
) -> dict[str, float]:
    """Forward/backward every micro-batch of ``step_batch`` through megatron's schedule (1F1B
    at PP > 1; the loss on the last stage), then one optimizer step."""
    denominator = loss_denominator(step_batch, config.calculate_per_token_loss, ctx.dp_group_gloo)
    model = ctx.model
    model.zero_grad_buffer()
    ctx.optimizer.zero_grad()
    step_metrics = StepMetrics()

    loss_type = getattr(ctx.args, "loss_type", "policy_loss")
    entropy_grad = entropy_needs_grad(loss_type, config)
    critic = loss_type == "value_loss"

    def add_metrics(loss: torch.Tensor, metrics: dict[str, torch.Tensor]) -> torch.Tensor:
        step_metrics.add({"step_loss": loss, **metrics})  # combined where they are
        return loss * ctx.dp_size

    def on_values(index: int, packed: PackedShard, values: torch.Tensor) -> torch.Tensor:
        return add_metrics(*packed_value_loss(values, packed, config, denominator))

    def on_scores(
        index: int, packed: PackedShard, log_probs: torch.Tensor, entropy: torch.Tensor
    ) -> torch.Tensor:
        loss, metrics = packed_score_loss(
            loss_type,
            log_probs,
            entropy,
            packed,
            config,
            denominator,
            detach_old=detach_old,
        )
        return add_metrics(loss, metrics)

    hook, hook_ctx = ctx.loss_hook, LossHookContext(ctx.args, ctx.device)

    def on_hook(index: int, packed: PackedShard, *outputs: torch.Tensor) -> torch.Tensor:
        assert hook is not None  # only scheduled with a hook
        given = outputs[0] if hook.wants_logits else TokenScores(*outputs)
        # the whole row: CP = 1 (refused at argument time otherwise)
        return add_metrics(*hook(hook_ctx, given, packed.full, config, denominator))

    multiple = row_pad_multiple()
    packed = [
        pack_thd(mb, pad_multiple=multiple).to(ctx.device)
        for mb in split_micro_batches(ctx, step_batch)
    ]
    if critic:
        run_schedule(model, packed, ValueScores(), on_values, forward_only=False)
    elif hook is not None and hook.wants_logits:
        run_schedule(model, packed, LogitsHead(ctx.vocab_size), on_hook, forward_only=False)
    else:
        head = ScoreHead(ctx.vocab_size, config.temperature, ctx.args.fused_log_probs, entropy_grad)
        run_schedule(model, packed, head, on_hook if hook else on_scores, forward_only=False)
    finalize_model_grads([model])
    lr = ctx.optimizer.param_groups[0]["lr"]
    update_ok, grad_norm, _ = ctx.optimizer.step()
    if update_ok:
        ctx.scheduler.step(increment=1)
    reduced, _ = step_metrics.reduce(ctx.dp_cp_group_gloo, ctx.cp_group)
    reduced = broadcast_from_last_stage(reduced)
    return {
        **reduced,
        "loss": reduced.pop("step_loss"),
        "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "lr": lr,
    }


def train_rollout(ctx: TrainContext, rollout_id: int, batch: RolloutBatch) -> dict[str, float]:
    """This rank's shard of one rollout: old log-probs, advantages, then the optimizer steps.

    Returns the mean over steps of each loss metric (extremes: their maximum or minimum), the
    last step's ``grad_norm`` and ``lr``,
    ``steps``, ``tokens_per_s`` (this rank) and ``step_losses``-free scalars only.
    """
    args = ctx.args
    config = LossConfig.from_algorithm(args.run_config.algorithm)
    start = time.perf_counter()
    model = ctx.model
    model.train()
    cfg = args.run_config
    num_steps = cfg.algorithm.num_steps_per_rollout  # the value the old policy's source reads
    source = old_policy.source(cfg.algorithm, cfg.roles)
    detach_old = source == old_policy.CURRENT
    # sft_loss and the critic's value_loss read no old or reference policy
    policy = args.loss_type == "policy_loss"
    if policy and source == old_policy.ROLLOUT:
        batch = old_policy.with_rollout_log_probs(batch)
    elif policy and old_policy.needs_forward(cfg.algorithm, cfg.roles):
        if ctx.before_log_prob_hook is not None:
            ctx.before_log_prob_hook(args, model, batch)
        index = {src: i for i, src in enumerate(batch.source_indices)}
        batch = batch.with_fields(
            old_log_probs=rollout_log_probs(
                model,
                split_micro_batches(ctx, batch),
                len(batch),
                index,
                ctx.vocab_size,
                args.rollout_temperature,
                ctx.device,
                fused=args.fused_log_probs,
            )
        )
    batch = with_advantages(batch, args, ctx.dp_group_gloo)
    results = []
    for step, step_batch in enumerate(split_steps(batch, num_steps, ctx.dp_group_gloo)):
        if ctx.before_train_step_hook is not None:
            ctx.before_train_step_hook(args, rollout_id, step, model, ctx.optimizer)
        step_batch = with_batch_mean(step_batch, config, ctx.dp_group_gloo)  # --tis-batch-normalize
        results.append(optimizer_step(ctx, step_batch, config, detach_old))
    metrics = mismatch.finish(over_steps(results))
    metrics["grad_norm"], metrics["lr"] = results[-1]["grad_norm"], results[-1]["lr"]
    tokens = sum(len(s.tokens) for s in batch)
    metrics["steps"] = float(len(results))
    metrics["tokens_per_s"] = tokens / max(time.perf_counter() - start, 1e-9)
    return metrics
