"""One rollout's training on one rank: log-probs, advantages, then the optimizer steps.

Built on miles-core's RL math (batch, micro-batching, THD packing, advantages, losses); nothing
here re-derives a formula. Flow of :func:`train_rollout` for this rank's shard:

1. micro-batches under ``--max-tokens-per-gpu`` (``--use-dynamic-batch-size``) or of
   ``--micro-batch-size`` samples; the count is the max over DP ranks so collectives line up;
2. with more than one step per rollout: the current policy's log-probs of every response token
   at ``--rollout-temperature`` (no grad) become ``old_log_probs``; with one step the loss uses
   ``log_probs.detach()`` instead, which is the same value without a second forward;
   ``--old-policy ema`` takes them from the EMA weights instead (always a second forward);
   with a KL term (``--kl-coef``/``--use-kl-loss``) the reference's log-probs become
   ``ref_log_probs`` (:mod:`miles_fsdp.roles`); a ``--custom-prepare-path`` hook runs first;
   ``--loss-type sft_loss`` and the critic (``value_loss``) skip this step;
3. advantages (``--advantage-estimator``, ``--normalize-advantages`` over all DP ranks; ``ppo``
   reads the critic's ``values`` field and adds ``returns``);
4. ``--num-steps-per-rollout`` optimizer steps, step ``k`` over this rank's part of the
   rollout's ``k``-th slice (:func:`~miles_core.micro_batch.split_steps`: the same samples at
   any DP size), with the loss denominator of the whole step across DP ranks (see :mod:`miles_fsdp.optimizer_step`), on
   the loss ``--loss-type`` names (:func:`_loss_of`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from miles_core import batch_invariant, mismatch, old_policy
from miles_core.advantages import with_advantages
from miles_core.aggregation import loss_denominator
from miles_core.args.groups.algorithm import kl_term_on
from miles_core.args.parsed import ParsedArgs
from miles_core.batch import RolloutBatch
from miles_core.custom_loss import TokenScores
from miles_core.log_prob_head import dense_log_probs
from miles_core.losses import (
    LossConfig,
    entropy_needs_grad,
    packed_score_loss,
    packed_value_loss,
)
from miles_core.metric_reduction import over_steps
from miles_core.micro_batch import MicroBatching, split_micro_batches, split_steps
from miles_core.packing import PackedBatch, pack_thd, packed_attention_kwargs, unpack_response
from miles_core.rollout_correction import with_batch_mean
from torch import nn

from miles_fsdp.adaptations.moe import RoutingReplay
from miles_fsdp.optimizer_step import StepResult, optimizer_step
from miles_fsdp.output_head import scoring
from miles_fsdp.roles import ref_mode, reference_forward
from miles_fsdp.value_head import values_of


@dataclass
class RolloutContext:
    """What :func:`train_rollout` needs from the backend."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    args: ParsedArgs
    device: torch.device
    dp_size: int
    cpu_group: Any
    attn_implementation: str
    compute_dtype: torch.dtype
    #: ``--use-rollout-routing-replay``: the patched routers' source of expert ids
    routing_replay: RoutingReplay | None = None
    reference: nn.Module | None = None  # --ref-mode ref
    ema: Any = None  # EMAOptimizer under --use-ema
    hooks: Any = None  # miles_fsdp.hooks.Hooks
    loss_scaler: Any = None  # miles_fsdp.loss_scale.LossScaler under --fp16
    profiler: Any = None  # miles_fsdp.profiling.TrainProfiler, around each optimizer step
    global_step: int = 0  # optimizer steps taken before this rollout


def micro_batches(ctx: RolloutContext, batch: RolloutBatch) -> list[RolloutBatch]:
    """This rank's micro-batches of ``batch``, as many as the busiest DP rank needs."""
    return split_micro_batches(
        batch, MicroBatching.from_algorithm(ctx.args.run_config.algorithm), group=ctx.cpu_group
    )


def packed_logits(
    ctx: RolloutContext, packed: PackedBatch, model: nn.Module | None = None
) -> torch.Tensor:
    """Logits ``[1, T, V]`` of a packed row (``model``: the actor unless given), attention kept
    inside each sample.

    With routing replay the actor's MoE routers take the row's ``routed_experts`` (the engine's
    ids).
    """
    if ctx.routing_replay is not None:
        if packed.routed_experts is None:
            raise ValueError(
                "--use-rollout-routing-replay: samples carry no routed_experts (ask the engine "
                "for them: return_routed_experts, --enable-return-routed-experts)"
            )
        ctx.routing_replay.set(packed.routed_experts)
    kwargs = packed_attention_kwargs(packed, ctx.attn_implementation, dtype=ctx.compute_dtype)
    model = ctx.model if model is None else model
    return model(input_ids=packed.input_ids, **kwargs).logits


def packed_scores(
    ctx: RolloutContext,
    packed: PackedBatch,
    temperature: float,
    model: nn.Module | None = None,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_probs, entropy)`` ``[1, T]`` float32 of a packed row at ``temperature``.

    ``--fused-log-probs`` (default): the output head computes them chunk by chunk from the
    hidden states (:mod:`miles_fsdp.output_head`), no ``[T, V]`` logits; otherwise from the
    materialised logits, the entropy without a graph unless ``entropy_grad``."""
    if ctx.args.fused_log_probs:
        head_model = ctx.model if model is None else model
        with scoring(head_model, packed.targets, temperature, entropy_grad):
            out = packed_logits(ctx, packed, model)
        return out[..., 0], out[..., 1]
    logits = packed_logits(ctx, packed, model)
    return dense_log_probs(logits, packed.targets, temperature, entropy_grad)


@torch.no_grad()
def _per_sample(
    ctx: RolloutContext,
    batch: RolloutBatch,
    per_token: Callable[[PackedBatch], torch.Tensor],
) -> list[torch.Tensor]:
    """Per-sample response-aligned ``per_token(packed)`` of gradient-free forwards."""
    out: list[torch.Tensor | None] = [None] * len(batch)
    index = {src: i for i, src in enumerate(batch.source_indices)}
    for mb in micro_batches(ctx, batch):
        packed = pack_thd(mb).to(ctx.device)
        parts = unpack_response(packed, per_token(packed))
        # one device-to-host copy per micro-batch, not one (and a host wait) per sample
        host = torch.cat([p.float() for p in parts]).cpu() if parts else torch.empty(0)
        for src, values in zip(mb.source_indices, host.split([p.numel() for p in parts])):
            out[index[src]] = values.clone()  # its own storage, as each sample travels alone
    return out  # type: ignore[return-value]


def policy_log_probs(
    ctx: RolloutContext, batch: RolloutBatch, model: nn.Module | None = None
) -> list[torch.Tensor]:
    """Per-sample response log-probs of ``model`` (the actor) at ``--rollout-temperature``."""
    temperature = ctx.args.rollout_temperature
    return _per_sample(ctx, batch, lambda packed: packed_scores(ctx, packed, temperature, model)[0])


def critic_values(ctx: RolloutContext, batch: RolloutBatch) -> list[torch.Tensor]:
    """Per-sample values ``V_t`` of the critic (``ctx.model``) for every response token."""
    return _per_sample(ctx, batch, lambda packed: values_of(packed_logits(ctx, packed)))


def _loss_of(
    ctx: RolloutContext, config: LossConfig, denominator: float, detach_old: bool, loss_type: str
):
    """The micro-batch loss of ``--loss-type``: ``value_loss`` (the critic: its values against
    the GAE returns, :func:`~miles_core.losses.packed_value_loss`), else through a
    ``--custom-loss-function-path`` hook when one is set, else ``sft_loss`` or ``policy_loss``
    (:func:`~miles_core.losses.packed_score_loss`, as the Megatron backend computes them)."""
    hook = ctx.hooks.loss if ctx.hooks is not None else None
    hook_wants_logits = hook is not None and hook.wants_logits

    def loss_of(model: nn.Module, mb: RolloutBatch):
        packed = pack_thd(mb).to(ctx.device)
        if loss_type == "value_loss":  # the critic's head gives one value per token
            values = values_of(packed_logits(ctx, packed))
            loss, metrics = packed_value_loss(values, packed, config, denominator)
            return loss, {"loss": loss.detach(), **metrics}
        if hook_wants_logits:  # --custom-loss-function-path taking ``logits``: the dense path
            return hook(ctx.hooks.context, packed_logits(ctx, packed), packed, config, denominator)
        entropy_grad = entropy_needs_grad(loss_type, config)
        log_probs, entropy = packed_scores(ctx, packed, config.temperature, None, entropy_grad)
        if hook is not None:  # a hook taking ``scores``: the lean path
            scores = TokenScores(log_probs, entropy)
            return hook(ctx.hooks.context, scores, packed, config, denominator)
        loss, metrics = packed_score_loss(
            loss_type,
            log_probs,
            entropy,
            packed,
            config,
            denominator,
            detach_old=detach_old,
        )
        if loss_type == "sft_loss":
            metrics = {"loss": loss.detach(), **metrics}
        return loss, metrics

    return loss_of


def _with_policy_log_probs(ctx: RolloutContext, batch: RolloutBatch) -> RolloutBatch:
    """``old_log_probs`` (step 2 of the module docstring; :mod:`miles_core.old_policy` says
    from where) and ``ref_log_probs`` when needed."""
    args = ctx.args
    cfg = args.run_config
    if old_policy.source(cfg.algorithm, cfg.roles) == old_policy.ROLLOUT:
        batch = old_policy.with_rollout_log_probs(batch)
    elif args.old_policy == "ema":
        with ctx.ema.use_weights(ctx.model):
            batch = batch.with_fields(old_log_probs=policy_log_probs(ctx, batch))
    elif old_policy.needs_forward(cfg.algorithm, cfg.roles):
        batch = batch.with_fields(old_log_probs=policy_log_probs(ctx, batch))
    if kl_term_on(args):
        with reference_forward(ctx.model, ctx.reference, ref_mode(args)) as ref:
            batch = batch.with_fields(ref_log_probs=policy_log_probs(ctx, batch, ref))
    return batch


def train_rollout(ctx: RolloutContext, batch: RolloutBatch) -> tuple[dict[str, float], int, int]:
    """Train on this rank's shard of one rollout; returns (metrics, steps, micro-batches).

    Metrics: the loss parts of :func:`compute_policy_loss` averaged over the steps (extremes:
    their maximum or minimum, :func:`~miles_core.metric_reduction.over_steps`), ``grad_norm``
    and ``lr`` of the last step, ``tokens_per_s`` (this rank) and ``peak_memory_gb`` on CUDA.
    Under ``--true-on-policy`` all of it runs in :func:`miles_core.batch_invariant.mode`.
    """
    on_policy = ctx.args.true_on_policy
    with batch_invariant.mode() if on_policy else contextlib.nullcontext():
        return _train_rollout(ctx, batch)


def _train_rollout(ctx: RolloutContext, batch: RolloutBatch) -> tuple[dict[str, float], int, int]:
    args = ctx.args
    config = LossConfig.from_algorithm(args.run_config.algorithm)
    start = time.perf_counter()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    cfg = args.run_config
    num_steps = cfg.algorithm.num_steps_per_rollout  # the value the old policy's source reads
    if ctx.hooks is not None and ctx.hooks.prepare is not None:
        batch = ctx.hooks.prepare(ctx.hooks.context, batch)
    loss_type = args.loss_type
    detach_old = old_policy.source(cfg.algorithm, cfg.roles) == old_policy.CURRENT
    if loss_type == "policy_loss":  # sft_loss and value_loss read no old or reference policy
        batch = _with_policy_log_probs(ctx, batch)
    batch = with_advantages(batch, args, ctx.cpu_group)

    results: list[StepResult] = []
    num_micro = 0
    for index, step_batch in enumerate(split_steps(batch, num_steps, ctx.cpu_group)):
        if ctx.profiler is not None:
            ctx.profiler.before_step(ctx.global_step + index)
        denominator = loss_denominator(
            step_batch, config.calculate_per_token_loss, group=ctx.cpu_group
        )
        step_batch = with_batch_mean(step_batch, config, ctx.cpu_group)
        step_micro = micro_batches(ctx, step_batch)
        num_micro += len(step_micro)
        results.append(
            optimizer_step(
                ctx.model,
                ctx.optimizer,
                ctx.scheduler,
                step_micro,
                _loss_of(ctx, config, denominator, detach_old, loss_type),
                dp_size=ctx.dp_size,
                clip_grad=args.clip_grad,
                loss_scaler=ctx.loss_scaler,
            )
        )
        if ctx.profiler is not None:
            ctx.profiler.after_step(ctx.global_step + index)
    elapsed = time.perf_counter() - start
    metrics = mismatch.finish(over_steps([r.parts for r in results]))
    metrics["grad_norm"] = results[-1].grad_norm
    metrics["lr"] = results[-1].lr
    if ctx.loss_scaler is not None:
        metrics["loss_scale"] = ctx.loss_scaler.scale
    metrics["tokens_per_s"] = batch.total_tokens / elapsed if elapsed > 0 else 0.0
    if torch.cuda.is_available():
        metrics["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return metrics, len(results), num_micro
