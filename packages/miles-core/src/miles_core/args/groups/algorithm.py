"""Batch sizes and the RL algorithm: advantages, policy loss, KL, entropy, TIS.

The formulas are in ``miles_core.advantages`` and ``miles_core.losses``; these are their knobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from miles_core.args.checks import at_least, flag_value, greater_than, requires, within
from miles_core.args.flags import ArgGroup, ArgumentError, flag
from miles_core.args.parsed import ParsedArgs

#: The flags that shape --use-tis's weights, with their defaults (refused when changed without it).
TIS_SETTINGS = {
    "tis_clip": 2.0,
    "tis_clip_low": 0.0,
    "tis_level": "token",
    "tis_mode": "truncate",
    "tis_veto_threshold": None,
    "tis_batch_normalize": False,
}
#: --opsm-delta's default (refused when changed without --use-opsm).
OPSM_DELTA = 1e-4


def tis_clip_bounds_error(tis_clip_low: float, tis_clip: float) -> str | None:
    """``0 <= --tis-clip-low < --tis-clip``, the one rule of the argument check and of
    :class:`~miles_core.losses.LossConfig`: what is wrong, or None."""
    if tis_clip_low < 0.0:
        return f"--tis-clip-low must be >= 0.0, got {tis_clip_low}"
    if tis_clip_low >= tis_clip:
        return f"--tis-clip-low ({tis_clip_low}) must be < --tis-clip ({tis_clip})"
    return None


def kl_term_on(args: ParsedArgs) -> bool:
    """A KL term is on: as a loss (``--use-kl-loss``) or in the reward (``--kl-coef`` > 0)."""
    return bool(args.use_kl_loss) or args.kl_coef > 0


def policy_loss_conflict(cfg: Any) -> str | None:
    """The one-line reason the estimator, ``--policy-loss`` and the aggregation flags of
    ``cfg`` (parsed flags or a :class:`~miles_core.losses.LossConfig`) do not define a loss
    together, or None."""
    estimator = cfg.advantage_estimator
    per_token = cfg.calculate_per_token_loss
    if estimator == "gspo" and per_token:
        return (
            "--advantage-estimator gspo cannot be used with --calculate-per-token-loss: GSPO's "
            "objective is a mean over sequences (Zheng et al. 2025, arXiv:2507.18071); a token mean would "
            "weight each sequence by its length"
        )
    if estimator == "dr_grpo" and per_token:
        return (
            "--advantage-estimator dr_grpo cannot be used with --calculate-per-token-loss: "
            "Dr. GRPO sums each response's tokens and averages over the responses (Liu et al. "
            "2025, arXiv:2503.20783)"
        )
    if cfg.policy_loss == "cispo":
        if estimator == "gspo":
            return (
                "--policy-loss cispo cannot be used with --advantage-estimator gspo: CISPO "
                "clips token-level importance weights, GSPO's ratio is a sequence's"
            )
        if cfg.eps_clip_c is not None:
            return "--eps-clip-c (dual clip) is PPO's: --policy-loss cispo does not use it"
    return None


@dataclass(frozen=True)
class AlgorithmArgs(ArgGroup):
    title: ClassVar[str] = "batch and algorithm"

    global_batch_size: int | None = flag(
        None,
        common=True,
        help="Samples per optimizer step: sets --num-steps-per-rollout to --rollout-batch-size x "
        "--n-samples-per-prompt / N (which N must divide) at argument time (unset: "
        "--num-steps-per-rollout decides).",
    )
    num_steps_per_rollout: int = flag(
        1,
        help="Optimizer steps per rollout: the rollout's samples, in rollout order, are cut into "
        "this many consecutive slices, one per step, whatever the data-parallel layout.",
    )
    micro_batch_size: int = flag(
        1, common=True, help="Samples per micro-batch when --use-dynamic-batch-size is off."
    )
    use_dynamic_batch_size: bool = flag(
        False, common=True, help="Form micro-batches by token count under --max-tokens-per-gpu."
    )
    max_tokens_per_gpu: int | None = flag(
        None,
        common=True,
        help="Token budget of one micro-batch per GPU (x CP with context parallelism).",
    )
    loss_type: Literal["policy_loss", "sft_loss", "value_loss", "nft"] = flag(
        "policy_loss",
        help="The actor's loss: policy_loss (the clipped policy objective) or sft_loss "
        "(negative log-likelihood of the responses under their loss mask); value_loss is the "
        "critic's (--use-critic).",
    )
    advantage_estimator: Literal[
        "grpo",
        "gspo",
        "dr_grpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "ppo",
    ] = flag(
        "grpo",
        common=True,
        help="Advantage estimator (docs/rl-math.md gives each formula; ppo needs a critic's "
        "values).",
    )
    policy_loss: Literal["ppo", "cispo"] = flag(
        "ppo",
        help="The policy objective: ppo (clipped ratio surrogate) or cispo (clipped, detached "
        "importance weight times the log-prob: every token keeps its gradient).",
    )
    custom_advantage_function_path: str | None = flag(
        None,
        metavar="MODULE:FUNC",
        help="Advantages from FUNC(args, batch) -> one tensor per sample (or "
        "miles_core.advantages.Advantages with returns, required under ppo) in place of the "
        "estimator's; --advantage-estimator still picks the loss's form.",
    )
    normalize_advantages: bool = flag(
        False, help="Whiten advantages over the response tokens of all DP ranks."
    )
    gamma: float = flag(1.0, help="Discount for reinforce_plus_plus returns and GAE.")
    lambd: float = flag(1.0, help="GAE lambda (ppo).")
    eps_clip: float = flag(
        0.2, common=True, help="PPO clip range: ratio in [1 - eps, 1 + eps-high]."
    )
    eps_clip_high: float | None = flag(None, help="Upper PPO clip range (unset: --eps-clip).")
    eps_clip_c: float | None = flag(
        None, help="Dual-clip bound c > 1 for negative advantages (unset: off)."
    )
    value_clip: float = flag(0.2, help="Clip range of the value loss (ppo critic).")
    kl_coef: float = flag(
        0.0, help="KL penalty folded into the reward (exclusive with --use-kl-loss)."
    )
    use_kl_loss: bool = flag(False, common=True, help="Add a KL loss against the reference model.")
    kl_loss_coef: float = flag(0.0, common=True, help="Weight of the KL loss.")
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = flag(
        "k1", help="KL estimator of the KL loss (k3 = low_var_kl, clamped to +-10)."
    )
    entropy_coef: float = flag(0.0, help="Weight of the entropy bonus.")
    use_tis: bool = flag(
        False, help="Truncated importance sampling against the rollout engine's log-probs."
    )
    tis_clip: float = flag(2.0, help="Upper truncation of the TIS weight.")
    tis_clip_low: float = flag(0.0, help="Lower truncation of the TIS weight.")
    tis_level: Literal["token", "sequence", "geometric"] = flag(
        "token",
        help="--use-tis weights per token, per sequence (the product of its token ratios) or "
        "the geometric mean of a sequence's token ratios (docs/rl-math.md).",
    )
    tis_mode: Literal["truncate", "mask"] = flag(
        "truncate",
        help="--use-tis: clamp the weight to [--tis-clip-low, --tis-clip] (truncate), or zero "
        "the tokens (at the sequence levels, the samples) whose weight lies outside (mask).",
    )
    tis_veto_threshold: float | None = flag(
        None,
        help="--use-tis: a sample with any trained token whose ratio pi_old / pi_rollout is "
        "below this gets weight 0 (unset: no veto).",
    )
    tis_batch_normalize: bool = flag(
        False,
        help="--use-tis: divide the weights by their mean over the optimizer step's trained "
        "tokens (token level) or samples (sequence levels), on all data-parallel ranks, so they "
        "average to 1 (costs an old-log-prob forward pass with one step per rollout).",
    )
    use_opsm: bool = flag(
        False,
        help="Off-policy sequence masking: a sample with negative advantage whose mean "
        "log pi_old - log pi over its trained tokens exceeds --opsm-delta leaves the policy "
        "loss (docs/rl-math.md).",
    )
    opsm_delta: float = flag(
        OPSM_DELTA, help="--use-opsm's threshold on a sample's mean log pi_old - log pi."
    )
    use_rollout_logprobs: bool = flag(
        False,
        help="The old-policy log-probs of the PPO ratio are the engine's sampled ones (no "
        "old-log-prob forward pass; the ratio also corrects the train/rollout mismatch).",
    )
    use_rollout_routing_replay: bool = flag(
        False,
        help="R3: route each token to the experts the rollout engine chose (samples' "
        "routed_experts) instead of the trainer's own top-k; weights still come from the "
        "trainer's router.",
    )
    true_on_policy: bool = flag(
        False,
        help="The engine's sampled log-probs and the trainer's are bitwise equal: both sides "
        "run batch-invariant ops (miles_core.batch_invariant); implies --use-rollout-logprobs. "
        "FSDP backend with the built-in engine: on CPU in float32, on a GPU in the checkpoint's "
        "bf16 or fp32; with SGLang engines, passes SGLang's own switches (not verified bitwise).",
    )
    calculate_per_token_loss: bool = flag(
        False, help="Average the loss over tokens (default: per sample, then over samples)."
    )
    rollout_temperature: float = flag(
        1.0, help="Sampling temperature; the trainer's log-probs use the same temperature."
    )
    fused_log_probs: bool = flag(
        True,
        help="Log-probs and entropy chunk by chunk from the hidden states, never holding the "
        "[T, V] logits (miles_core.log_prob_head); --no-fused-log-probs materialises the "
        "logits (the dense path, for debugging).",
    )

    @classmethod
    def resolve_defaults(cls, args: ParsedArgs) -> None:
        if args.true_on_policy:
            # the old policy is the engine's: its log-probs are bitwise the trainer's
            args.use_rollout_logprobs = True

    @classmethod
    def validate(cls, args: ParsedArgs) -> None:
        at_least(args, "global_batch_size", 1)
        at_least(args, "num_steps_per_rollout", 1)
        at_least(args, "micro_batch_size", 1)
        at_least(args, "max_tokens_per_gpu", 1)
        requires(args, "use_dynamic_batch_size", "max_tokens_per_gpu")
        fixed_micro_batches = not args.use_dynamic_batch_size
        if (
            fixed_micro_batches
            and args.global_batch_size is not None
            and args.global_batch_size % args.micro_batch_size
        ):
            raise ArgumentError(
                f"--global-batch-size ({args.global_batch_size}) must be a multiple of "
                f"--micro-batch-size ({args.micro_batch_size})"
            )
        if args.global_batch_size is not None and not hasattr(args, "rollout_batch_size"):
            raise ArgumentError(
                "--global-batch-size needs the launcher's --rollout-batch-size and "
                "--n-samples-per-prompt to become optimizer steps; give --num-steps-per-rollout"
            )
        if args.loss_type == "nft":
            raise ArgumentError(
                "--loss-type nft (EMA as pi_old) is offered for causal LMs as "
                "--old-policy ema (with --use-ema)"
            )
        if args.loss_type == "value_loss":
            raise ArgumentError(
                "--loss-type value_loss is the critic's loss (--use-critic trains one with it); "
                "the actor takes policy_loss or sft_loss"
            )
        if args.loss_type == "sft_loss":
            for given, what in (
                (args.true_on_policy, "--true-on-policy"),
                (args.use_kl_loss, "--use-kl-loss"),
                (args.use_tis, "--use-tis"),
                (args.use_rollout_logprobs, "--use-rollout-logprobs"),
                (args.use_opsm, "--use-opsm"),
                (args.entropy_coef != 0.0, f"--entropy-coef {args.entropy_coef}"),
                (args.kl_coef != 0.0, f"--kl-coef {args.kl_coef}"),
            ):
                if given:
                    raise ArgumentError(
                        f"--loss-type sft_loss ignores {what} (the responses' negative "
                        "log-likelihood has no KL, importance-sampling or entropy term)"
                    )
        within(args, "gamma", 0.0, 1.0)
        within(args, "lambd", 0.0, 1.0)
        greater_than(args, "eps_clip", 0.0)
        greater_than(args, "eps_clip_high", 0.0)
        greater_than(args, "eps_clip_c", 1.0)
        at_least(args, "value_clip", 0.0)
        at_least(args, "kl_coef", 0.0)
        at_least(args, "kl_loss_coef", 0.0)
        at_least(args, "entropy_coef", 0.0)
        if args.kl_coef > 0 and args.use_kl_loss:
            raise ArgumentError(
                "--kl-coef > 0 (KL in the reward) and --use-kl-loss are mutually exclusive"
            )
        conflict = policy_loss_conflict(args)
        if conflict:
            raise ArgumentError(conflict)
        if args.policy_loss != "ppo" and args.loss_type != "policy_loss":
            raise ArgumentError(
                f"--policy-loss {args.policy_loss} shapes --loss-type policy_loss, not "
                f"{args.loss_type}"
            )
        greater_than(args, "tis_clip", 0.0)
        greater_than(args, "tis_veto_threshold", 0.0)
        tis_bounds = tis_clip_bounds_error(args.tis_clip_low, args.tis_clip)
        if tis_bounds:
            raise ArgumentError(tis_bounds)
        if not args.use_tis:
            for dest, default in TIS_SETTINGS.items():
                if flag_value(args, dest) != default:
                    raise ArgumentError(
                        f"--{dest.replace('_', '-')} {flag_value(args, dest)} shapes --use-tis's "
                        "weights, which are off (add --use-tis)"
                    )
        at_least(args, "opsm_delta", 0.0)
        if not args.use_opsm and args.opsm_delta != OPSM_DELTA:
            raise ArgumentError(
                f"--opsm-delta {args.opsm_delta} shapes --use-opsm, which is off (add --use-opsm)"
            )
        if (
            args.use_opsm
            and not args.use_rollout_logprobs
            and args.num_steps_per_rollout == 1
            and args.old_policy != "ema"
        ):
            raise ArgumentError(
                "--use-opsm with the current policy as pi_old (one step per rollout): every "
                "sample's mean log pi_old - log pi is 0, nothing would be masked (add "
                "--use-rollout-logprobs, --num-steps-per-rollout > 1 or --old-policy ema)"
            )
        if args.use_rollout_logprobs and args.use_tis:
            raise ArgumentError(
                "--use-tis with --use-rollout-logprobs: the old policy is the engine's, so the "
                "TIS weight pi_old / pi_rollout is exactly 1; the PPO ratio already corrects "
                "the mismatch (drop one of them)"
            )
        if args.use_rollout_logprobs and args.old_policy != "actor":
            raise ArgumentError(
                f"--use-rollout-logprobs with --old-policy {args.old_policy}: the old policy is "
                "either the engine's or the EMA's (drop one of them)"
            )
        greater_than(args, "rollout_temperature", 0.0)
        if args.custom_advantage_function_path and args.kl_coef > 0:
            raise ArgumentError(
                "--custom-advantage-function-path with --kl-coef > 0: the function computes the "
                "advantages, so --kl-coef would go unused; put a KL penalty in the function or "
                "use --use-kl-loss"
            )

    @classmethod
    def check_paths(cls, args: ParsedArgs) -> None:
        if args.custom_advantage_function_path:
            # a cycle: miles_core.user_functions imports miles_core.args (and so this group)
            from miles_core.user_functions import load_function

            load_function(args.custom_advantage_function_path, "--custom-advantage-function-path")
