"""Policy, value and SFT losses, as pure functions of per-token tensors.

All inputs are per-token tensors of one shape (typically a packed micro-batch ``[1, T]`` or its
flattening), aligned as :class:`~miles_core.packing.PackedBatch` aligns them: position ``t`` holds
the values of the token *predicted* at ``t``. ``loss_mask`` selects the response tokens that train.
Every loss is reduced with :func:`~miles_core.aggregation.aggregate` against a step-wide
``denominator`` (:func:`~miles_core.aggregation.loss_denominator`), so micro-batch losses add up.

Metrics are returned the same way: each is this micro-batch's share of the step's token- or
sequence-mean; summing a metric over micro-batches and DP ranks gives the step value.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from miles_core.advantages import ESTIMATORS
from miles_core.aggregation import aggregate, segment_mean
from miles_core.args.groups.algorithm import (
    AlgorithmArgs,
    policy_loss_conflict,
    tis_clip_bounds_error,
)
from miles_core.kl import KL_TYPES, kl_estimate
from miles_core.mismatch import extremes as mismatch_extremes
from miles_core.mismatch import token_terms as mismatch_terms
from miles_core.off_policy_masking import opsm_mask
from miles_core.rollout_correction import (
    BATCH_MEAN_FIELD,
    LEVELS,
    MODES,
    configured_weights,
    rollout_is_weights,
)

LOG_RATIO_CLAMP = 20.0


#: LossConfig's field names that differ from the flag's (``--rollout-temperature``).
FLAG_OF_FIELD = {"temperature": "rollout_temperature"}


def _default(dest: str) -> Any:
    """The default of ``AlgorithmArgs.<dest>``: LossConfig declares none of its own."""
    return AlgorithmArgs.__dataclass_fields__[dest].default


@dataclass(frozen=True)
class LossConfig:
    """The loss settings; each field is the flag of the same name of
    :class:`~miles_core.args.groups.AlgorithmArgs` (``temperature`` is ``--rollout-temperature``),
    whose default it takes: build it from the parsed group with :meth:`from_algorithm`."""

    advantage_estimator: str = _default("advantage_estimator")
    eps_clip: float = _default("eps_clip")
    eps_clip_high: float | None = _default("eps_clip_high")
    eps_clip_c: float | None = _default("eps_clip_c")
    value_clip: float = _default("value_clip")
    kl_coef: float = _default("kl_coef")
    use_kl_loss: bool = _default("use_kl_loss")
    kl_loss_coef: float = _default("kl_loss_coef")
    kl_loss_type: str = _default("kl_loss_type")
    entropy_coef: float = _default("entropy_coef")
    use_tis: bool = _default("use_tis")
    tis_clip: float = _default("tis_clip")
    tis_clip_low: float = _default("tis_clip_low")
    tis_level: str = _default("tis_level")
    tis_mode: str = _default("tis_mode")
    tis_veto_threshold: float | None = _default("tis_veto_threshold")
    tis_batch_normalize: bool = _default("tis_batch_normalize")
    use_opsm: bool = _default("use_opsm")
    opsm_delta: float = _default("opsm_delta")
    calculate_per_token_loss: bool = _default("calculate_per_token_loss")
    temperature: float = _default("rollout_temperature")
    policy_loss: str = _default("policy_loss")
    use_rollout_logprobs: bool = _default("use_rollout_logprobs")

    def __post_init__(self) -> None:
        if self.advantage_estimator not in ESTIMATORS:
            raise ValueError(
                f"--advantage-estimator must be one of {', '.join(ESTIMATORS)}, "
                f"got {self.advantage_estimator!r}"
            )
        if self.kl_loss_type not in KL_TYPES:
            raise ValueError(
                f"--kl-loss-type must be one of {', '.join(KL_TYPES)}, got {self.kl_loss_type!r}"
            )
        if self.eps_clip_c is not None and self.eps_clip_c <= 1.0:
            raise ValueError(f"--eps-clip-c must be > 1 (dual clip), got {self.eps_clip_c}")
        if self.use_kl_loss and self.kl_coef != 0.0:
            raise ValueError(
                "--use-kl-loss and --kl-coef (KL in the reward) are mutually exclusive"
            )
        tis_bounds = tis_clip_bounds_error(self.tis_clip_low, self.tis_clip)
        if self.use_tis and tis_bounds:
            raise ValueError(tis_bounds)
        if self.use_tis and self.tis_level not in LEVELS:
            raise ValueError(
                f"--tis-level must be one of {', '.join(LEVELS)}, got {self.tis_level!r}"
            )
        if self.use_tis and self.tis_mode not in MODES:
            raise ValueError(f"--tis-mode must be one of {', '.join(MODES)}, got {self.tis_mode!r}")
        if self.temperature <= 0:
            raise ValueError(f"--rollout-temperature must be > 0, got {self.temperature}")
        conflict = policy_loss_conflict(self)
        if conflict:
            raise ValueError(conflict)

    @property
    def token_sum(self) -> bool:
        """The policy loss sums the masked tokens and divides by the step's denominator:
        ``--calculate-per-token-loss`` (token mean) and ``dr_grpo`` (token sum per response,
        mean over the responses: its denominator counts samples)."""
        return self.calculate_per_token_loss or self.advantage_estimator == "dr_grpo"

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @classmethod
    def from_algorithm(cls, algorithm: AlgorithmArgs) -> LossConfig:
        """The loss settings of the parsed algorithm group (``args.run_config.algorithm``; the
        critic's namespace from :func:`~miles_core.args.groups.critic.critic_args` has its own)."""
        return cls(
            **{f.name: getattr(algorithm, FLAG_OF_FIELD.get(f.name, f.name)) for f in fields(cls)}
        )


def ppo_clip_loss(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate loss (PPO), optionally dual-clipped.

    With ``r = exp(clamp(log_ratio, -20, 20))``, ``A`` the advantage, ``e_lo = eps_clip`` and
    ``e_hi = eps_clip_high`` (default ``eps_clip``)::

        loss = max(-A * r, -A * clamp(r, 1 - e_lo, 1 + e_hi))
        dual clip (c = eps_clip_c > 1), only where A < 0:  loss = min(loss, -A * c)

    Returns ``(loss, clipped, dual_clipped)``; ``clipped`` is 1.0 where the clipped term was
    chosen (strictly larger), ``dual_clipped`` where the dual clip bound was active.
    """
    high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    unclipped = -advantages * ratio
    clipped_term = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    loss = torch.maximum(unclipped, clipped_term)
    clipped = (clipped_term > unclipped).float()
    dual_clipped = torch.zeros_like(clipped)
    if eps_clip_c is not None:
        bound = -advantages * eps_clip_c
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
        dual_clipped = dual.float()
    return loss, clipped, dual_clipped


def gspo_log_ratio(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    sample_ids: torch.Tensor,
    num_samples: int,
) -> torch.Tensor:
    """GSPO's sequence-level log importance ratio, spread over tokens ("GSPO-token").

    ``log s_i = (1 / n_i) * sum_{t in i} m_t (log pi_t - log pi_old_t)`` is the length-normalised
    sequence log-ratio. Each token gets ``sg[log s_i] + log pi_t - sg[log pi_t]``: its value is
    ``log s_i`` and its gradient is that of ``log pi_t``, so with sequence-mean aggregation the
    gradient equals GSPO's ``s_i * (1 / n_i) * sum_t grad log pi_t``.
    """
    diff = (log_probs - old_log_probs).reshape(-1)
    seq = segment_mean(diff.detach(), loss_mask, sample_ids, num_samples)
    ids = sample_ids.reshape(-1).long().clamp(min=0)
    flat_lp = log_probs.reshape(-1)
    out = seq[ids] + flat_lp - flat_lp.detach()
    return out.reshape(log_probs.shape)


def tis_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    tis_clip: float,
    tis_clip_low: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance-sampling weights correcting for the engine/trainer mismatch.

    ``w = clamp(exp(log pi_old - log pi_rollout), tis_clip_low, tis_clip)`` (no gradient), where
    ``pi_old`` is the trainer's policy at rollout time and ``pi_rollout`` the engine's. The log
    difference is clamped to +-20 before ``exp``. Returns ``(w, truncated)`` with ``truncated``
    1.0 where the clamp was active. (``--tis-level token --tis-mode truncate`` of
    :func:`miles_core.rollout_correction.rollout_is_weights`.)
    """
    w, truncated, _ = rollout_is_weights(
        old_log_probs, rollout_log_probs, clip=tis_clip, clip_low=tis_clip_low
    )
    return w, truncated


def cispo_loss(
    log_ratio: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO's per-token loss (MiniMax-M1, arXiv:2506.13585): the importance weight
    is clipped and detached, never the token's gradient::

        loss = -sg[clamp(r, 1 - e_lo, 1 + e_hi)] * A * log pi,   r = exp(clamp(log_ratio, +-20))

    so every token contributes ``-clamp(r) A grad log pi``. Returns ``(loss, clipped)``, the
    latter 1.0 where the clamp changed ``r``.
    """
    high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    weight = ratio.clamp(1.0 - eps_clip, 1.0 + high)
    return -weight * advantages * log_probs, (weight != ratio).float()


def compute_policy_loss(
    log_probs: torch.Tensor,
    *,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    config: LossConfig,
    denominator: float,
    sample_ids: torch.Tensor | None = None,
    num_samples: int | None = None,
    ref_log_probs: torch.Tensor | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    sample_loss_tokens: torch.Tensor | None = None,
    tis_batch_mean: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor loss of one micro-batch::

        loss = agg(w * o * ppo_clip_loss(log_ratio, A))   w: --use-tis's weights, else 1
                                                          o: 0 where --use-opsm masks, else 1
               - entropy_coef * agg(entropy)              when entropy is given
               + kl_loss_coef * agg(kl_estimate(log pi, log pi_ref, --kl-loss-type))  --use-kl-loss

    ``log_ratio`` is ``log pi - log pi_old`` or, for ``--advantage-estimator gspo``,
    :func:`gspo_log_ratio`; ``--policy-loss cispo`` takes :func:`cispo_loss` in place of
    ``ppo_clip_loss``. ``agg`` is :func:`~miles_core.aggregation.aggregate` (token mean with
    ``--calculate-per-token-loss``, token sum over the step's sample count for ``dr_grpo``,
    else sequence mean, which needs ``sample_ids``; ``sample_loss_tokens`` is passed on to it).
    Under ``dr_grpo`` the metrics other than ``loss`` and ``pg_loss`` are sequence means.
    ``tis_batch_mean`` (per token, ``--tis-batch-normalize``): the step's mean weight ``w`` is
    divided by (:func:`miles_core.rollout_correction.with_batch_mean`).

    Metrics (detached, shares of step means): ``loss``, ``pg_loss``, ``pg_clipfrac``,
    ``pg_dual_clipfrac``, ``ppo_kl`` (approximate KL, mean of ``log pi_old - log pi``), and when
    applicable ``entropy``, ``kl_loss``, ``tis`` (mean weight), ``tis_clipfrac``,
    ``tis_veto_frac``, ``tis_batch_mean``, ``opsm_masked_frac``, ``opsm_masked_samples`` (a
    count: :mod:`miles_core.off_policy_masking`); with
    ``rollout_log_probs``, the train/rollout mismatch of ``old_log_probs`` against them
    (:mod:`miles_core.mismatch`; of the current ``log_probs`` under
    ``--use-rollout-logprobs``, where ``old_log_probs`` are the engine's), whose extremes are
    not shares but combine as :mod:`miles_core.metric_reduction` says.
    """

    def agg(values: torch.Tensor, token_sum: bool = config.token_sum) -> torch.Tensor:
        return aggregate(
            values,
            loss_mask,
            denominator,
            token_sum,
            sample_ids=sample_ids,
            num_samples=num_samples,
            sample_loss_tokens=sample_loss_tokens,
        )

    def mean(values: torch.Tensor) -> torch.Tensor:  # a metric: a mean under dr_grpo too
        return agg(values, config.calculate_per_token_loss)

    if config.advantage_estimator == "gspo":
        if sample_ids is None or num_samples is None:
            raise ValueError("--advantage-estimator gspo needs sample_ids and num_samples")
        log_ratio = gspo_log_ratio(log_probs, old_log_probs, loss_mask, sample_ids, num_samples)
    else:
        log_ratio = log_probs - old_log_probs
    if config.policy_loss == "cispo":
        pg, clipped = cispo_loss(
            log_ratio, log_probs, advantages, config.eps_clip, config.clip_high
        )
        dual_clipped = torch.zeros_like(clipped)
    else:
        pg, clipped, dual_clipped = ppo_clip_loss(
            log_ratio, advantages, config.eps_clip, config.clip_high, config.eps_clip_c
        )
    metrics: dict[str, torch.Tensor] = {}
    if rollout_log_probs is not None:
        # the trainer's side: pi_old, or the current policy when pi_old is the engine's own
        train_side = log_probs.detach() if config.use_rollout_logprobs else old_log_probs
        terms = mismatch_terms(train_side, rollout_log_probs)
        for name, values in terms.items():
            metrics[name] = mean(values)
        metrics.update(
            mismatch_extremes(terms, loss_mask, sample_ids, num_samples, sample_loss_tokens)
        )
    if config.use_tis:
        if rollout_log_probs is None:
            raise ValueError("--use-tis needs the rollout log-probs of every sample")
        w, changed, vetoed = configured_weights(
            config,
            old_log_probs,
            rollout_log_probs,
            loss_mask=loss_mask,
            sample_ids=sample_ids,
            num_samples=num_samples,
        )
        if config.tis_batch_normalize:  # the step's mean weight, on every token
            if tis_batch_mean is None:
                raise ValueError(
                    "--tis-batch-normalize needs the step's mean weight "
                    "(miles_core.rollout_correction.with_batch_mean)"
                )
            # outside the responses (prompts, padding) a packed field is 0: divide by 1 there
            w = w / torch.where(tis_batch_mean > 0, tis_batch_mean, torch.ones_like(w))
            metrics["tis_batch_mean"] = mean(tis_batch_mean)
        pg = pg * w
        metrics["tis"] = mean(w).detach()
        metrics["tis_clipfrac"] = mean(changed).detach()
        if config.tis_veto_threshold is not None:
            metrics["tis_veto_frac"] = mean(vetoed).detach()
    if config.use_opsm:
        if sample_ids is None or num_samples is None:
            raise ValueError("--use-opsm needs sample_ids and num_samples")
        masked, masked_samples = opsm_mask(
            log_probs, old_log_probs, advantages, loss_mask, sample_ids, num_samples,
            config.opsm_delta,
        )  # fmt: skip
        pg = pg * (1.0 - masked)
        metrics["opsm_masked_frac"] = mean(masked)
        metrics["opsm_masked_samples"] = masked_samples
    pg_loss = agg(pg)
    loss = pg_loss
    metrics["pg_loss"] = pg_loss.detach()
    metrics["pg_clipfrac"] = mean(clipped).detach()
    metrics["pg_dual_clipfrac"] = mean(dual_clipped).detach()
    metrics["ppo_kl"] = mean((old_log_probs - log_probs).detach())
    if entropy is not None:
        metrics["entropy"] = mean(entropy.detach())
        if config.entropy_coef != 0.0:
            loss = loss - config.entropy_coef * agg(entropy)
    if config.use_kl_loss:
        if ref_log_probs is None:
            raise ValueError("--use-kl-loss needs reference log-probs")
        kl = kl_estimate(log_probs, ref_log_probs, config.kl_loss_type)
        metrics["kl_loss"] = mean(kl.detach())
        loss = loss + config.kl_loss_coef * agg(kl)
    metrics["loss"] = loss.detach()
    return loss, metrics


def compute_value_loss(
    values: torch.Tensor,
    *,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    value_clip: float,
    denominator: float,
    per_token_loss: bool,
    sample_ids: torch.Tensor | None = None,
    num_samples: int | None = None,
    sample_loss_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (critic, ``--advantage-estimator ppo``)::

        v_clip = v_old + clamp(v - v_old, -value_clip, value_clip)
        loss   = agg(0.5 * max((v - R)^2, (v_clip - R)^2))

    with ``R`` the GAE returns. Metrics: ``value_loss``, ``value_clipfrac`` (where the clipped
    error was strictly larger). ``sample_loss_tokens`` as for :func:`compute_policy_loss`.
    """
    v_clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    err = (values - returns).square()
    err_clipped = (v_clipped - returns).square()
    per_token = 0.5 * torch.maximum(err, err_clipped)
    clipped = (err_clipped > err).float()
    common = dict(
        sample_ids=sample_ids, num_samples=num_samples, sample_loss_tokens=sample_loss_tokens
    )
    loss = aggregate(per_token, loss_mask, denominator, per_token_loss, **common)
    clipfrac = aggregate(clipped, loss_mask, denominator, per_token_loss, **common)
    return loss, {"value_loss": loss.detach(), "value_clipfrac": clipfrac.detach()}


def sft_loss(
    log_probs: torch.Tensor,
    *,
    loss_mask: torch.Tensor,
    denominator: float,
    per_token_loss: bool,
    sample_ids: torch.Tensor | None = None,
    num_samples: int | None = None,
    sample_loss_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Negative log-likelihood of the masked tokens: ``loss = agg(-log pi_t)``
    (``sample_loss_tokens`` as for :func:`compute_policy_loss`)."""
    loss = aggregate(
        -log_probs,
        loss_mask,
        denominator,
        per_token_loss,
        sample_ids=sample_ids,
        num_samples=num_samples,
        sample_loss_tokens=sample_loss_tokens,
    )
    return loss, {"sft_loss": loss.detach()}


def packed_value_loss(
    values: torch.Tensor, packed: Any, config: LossConfig, denominator: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`compute_value_loss` of a packed micro-batch (a
    :class:`~miles_core.packing.PackedBatch` or a context-parallel shard of one: its ``fields``
    hold ``values`` and ``returns``)."""
    return compute_value_loss(
        values,
        old_values=packed.fields["values"],
        returns=packed.fields["returns"],
        loss_mask=packed.loss_mask,
        value_clip=config.value_clip,
        denominator=denominator,
        per_token_loss=config.calculate_per_token_loss,
        sample_ids=packed.sample_ids,
        num_samples=packed.num_samples,
        sample_loss_tokens=packed.sample_loss_tokens,
    )


def entropy_needs_grad(loss_type: str, config: LossConfig) -> bool:
    """Whether the entropy enters the loss (``policy_loss`` with ``--entropy-coef`` set); else it
    is a metric, and the log-prob head computes no gradient for it."""
    return loss_type == "policy_loss" and config.entropy_coef != 0.0


def packed_score_loss(
    loss_type: str,
    log_probs: torch.Tensor,
    entropy: torch.Tensor,
    packed: Any,
    config: LossConfig,
    denominator: float,
    *,
    detach_old: bool,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The ``--loss-type`` loss (``sft_loss`` or ``policy_loss``) of a packed micro-batch from
    its scores. ``detach_old``: the old log-probs are the current ones, detached (one step per
    rollout). The entropy is detached unless :func:`entropy_needs_grad`."""
    common = dict(  # whole-sample counts: a context-parallel shard holds part of each sample
        loss_mask=packed.loss_mask,
        denominator=denominator,
        sample_ids=packed.sample_ids,
        num_samples=packed.num_samples,
        sample_loss_tokens=packed.sample_loss_tokens,
    )
    if loss_type == "sft_loss":
        return sft_loss(log_probs, per_token_loss=config.calculate_per_token_loss, **common)
    fields = packed.fields
    return compute_policy_loss(
        log_probs,
        old_log_probs=log_probs.detach() if detach_old else fields["old_log_probs"],
        advantages=fields["advantages"],
        config=config,
        ref_log_probs=fields.get("ref_log_probs"),
        rollout_log_probs=fields.get("rollout_log_probs"),
        tis_batch_mean=fields.get(BATCH_MEAN_FIELD),
        entropy=entropy if entropy_needs_grad(loss_type, config) else entropy.detach(),
        **common,
    )
