"""The critic (``--use-critic``): a value model trained beside the actor for PPO.

The critic is built by the actor's backend from ``--critic-hf-checkpoint`` (unset:
``--hf-checkpoint``; another HF causal LM of the same vocabulary) with a value head in place
of the LM head, trained with the clipped value loss (``--value-clip``) on the GAE returns of its
own values (``--gamma``, ``--lambd``); the actor's advantages come from the same values. It has
its own optimizer (``--critic-lr``, ``--critic-lr-warmup-iters``, the actor's other optimizer
flags) and checkpoint: ``--critic-save`` / ``--critic-load``, by default the ``critic/``
directory inside ``--save`` / ``--load``, saved at the actor's save points. It never publishes.
:func:`critic_args` is the namespace the critic's backend is initialised with.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from typing import Any, ClassVar

from miles_core.args.checks import at_least, option, requires
from miles_core.args.flags import ArgGroup, ArgumentError, flag
from miles_core.args.parsed import ParsedArgs

#: The critic's checkpoint directory inside ``--save`` / ``--load`` when not given.
CRITIC_SUBDIR = "critic"

#: Flags that need --use-critic.
CRITIC_ONLY = (
    "critic_lr",
    "critic_lr_warmup_iters",
    "critic_load",
    "critic_save",
    "critic_hf_checkpoint",
)


@dataclass(frozen=True)
class CriticArgs(ArgGroup):
    title: ClassVar[str] = "critic (PPO)"

    use_critic: bool = flag(
        False,
        common=True,
        help="Train a critic (value model) beside the actor; its values feed GAE "
        "(--advantage-estimator ppo, which needs it).",
    )
    critic_lr: float | None = flag(
        None, common=True, help="Learning rate of the critic (unset: --lr)."
    )
    critic_lr_warmup_iters: int | None = flag(
        None, help="Warm-up steps of the critic's learning rate (unset: --lr-warmup-iters)."
    )
    critic_hf_checkpoint: str | None = flag(
        None,
        metavar="DIR",
        help="HF causal LM the critic starts from, its LM head replaced by the value head (same "
        "vocabulary as --hf-checkpoint; unset: --hf-checkpoint). --critic-load still names the "
        "critic checkpoint to resume from.",
    )
    critic_load: str | None = flag(
        None, metavar="DIR", help="Critic checkpoint to resume from (unset: <--load>/critic)."
    )
    critic_save: str | None = flag(
        None, metavar="DIR", help="Where the critic's checkpoints go (unset: <--save>/critic)."
    )
    num_critic_only_steps: int = flag(
        0, help="First rollouts that train only the critic (the actor is not updated)."
    )

    @classmethod
    def validate(cls, args: ParsedArgs) -> None:
        if args.advantage_estimator == "ppo" and not args.use_critic:
            raise ArgumentError(
                "--advantage-estimator ppo needs --use-critic (GAE takes a critic's values)"
            )
        if args.use_critic and args.advantage_estimator != "ppo":
            raise ArgumentError(
                f"--use-critic: only --advantage-estimator ppo uses a critic's values, "
                f"not {args.advantage_estimator}"
            )
        for dest in CRITIC_ONLY:
            requires(args, dest, "use_critic")
        if args.num_critic_only_steps:
            requires(args, "num_critic_only_steps", "use_critic")
        at_least(args, "num_critic_only_steps", 0)
        at_least(args, "critic_lr", 0.0)
        at_least(args, "critic_lr_warmup_iters", 0)
        if args.use_critic and args.kl_coef > 0:
            raise ArgumentError(
                "--use-critic with --kl-coef > 0 (KL in the reward) is not supported: the critic "
                "trains on its returns before the actor computes the policy's and the "
                "reference's log-probs that KL needs; use --use-kl-loss for a KL term"
            )
        if args.use_critic and args.loss_type != "policy_loss":
            raise ArgumentError(
                f"--use-critic trains the actor with --loss-type policy_loss, not {args.loss_type}"
            )

    @classmethod
    def check_paths(cls, args: ParsedArgs) -> None:
        if args.critic_hf_checkpoint:
            check_critic_checkpoint(args.critic_hf_checkpoint, args.hf_checkpoint)

    @classmethod
    def resolve_defaults(cls, args: ParsedArgs) -> None:
        if not args.use_critic:
            return
        if args.critic_save is None and args.save:
            args.critic_save = os.path.join(args.save, CRITIC_SUBDIR)
        if args.critic_load is None and args.load:
            args.critic_load = os.path.join(args.load, CRITIC_SUBDIR)


def _text_config(path: str) -> dict:

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    return config.get("text_config") or config


def check_critic_checkpoint(critic: str, actor: str | None) -> None:
    """``--critic-hf-checkpoint``: an HF causal LM directory whose vocabulary size is the
    actor's (the critic reads the actor's token ids)."""
    flag_ = "--critic-hf-checkpoint"
    if not os.path.isfile(os.path.join(critic, "config.json")):
        raise ArgumentError(f"{flag_} {critic}: no config.json (an HF model directory)")
    config = _text_config(critic)
    architectures = config.get("architectures") or []
    if any(not a.endswith("ForCausalLM") for a in architectures):
        raise ArgumentError(
            f"{flag_} {critic}: {', '.join(architectures)} is not a causal LM (a reward model's "
            "own head is not loaded yet: give its causal LM base)"
        )
    if actor and os.path.isfile(os.path.join(actor, "config.json")):
        ours, theirs = _text_config(actor).get("vocab_size"), config.get("vocab_size")
        if ours != theirs:
            raise ArgumentError(
                f"{flag_} {critic}: vocab_size {theirs} differs from --hf-checkpoint's {ours} "
                "(the critic reads the actor's token ids)"
            )


def critic_args(args: ParsedArgs) -> Any:
    """The namespace the critic's backend is built with: a copy of ``args`` with
    ``--loss-type value_loss``, the ``--critic-*`` values in place of the actor's (learning
    rate, warm-up, save and load directories, the HF checkpoint), no RNG restore (the actor's checkpoint holds the
    process's RNG state), its scalars in ``<--tensorboard-dir>/critic``, no profiler window (the
    actor's) and none of the actor-only roles (LoRA, EMA, reference, teacher, custom hooks),
    with its own ``run_config``."""
    if not args.use_critic:
        raise ArgumentError(f"{option('use_critic')} is off: there is no critic")
    out = copy.copy(args)
    out.loss_type = "value_loss"
    out.lr = args.lr if args.critic_lr is None else args.critic_lr
    if args.critic_lr_warmup_iters is not None:
        out.lr_warmup_iters = args.critic_lr_warmup_iters
    out.save = args.critic_save
    out.load = args.critic_load
    if args.critic_hf_checkpoint:
        out.hf_checkpoint = args.critic_hf_checkpoint
    out.load_rng = False
    out.use_lora = False
    out.lora_adapter_path = None
    out.use_ema = False
    out.rollout_weights = out.eval_weights = out.old_policy = "actor"
    out.ref_load = out.teacher_load = None
    out.ref_mode = "none"
    out.use_kl_loss = out.use_rollout_logprobs = False
    out.custom_prepare_path = out.custom_loss_function_path = None
    if args.tensorboard_dir:
        out.tensorboard_dir = os.path.join(args.tensorboard_dir, CRITIC_SUBDIR)
    for dest in ("use_pytorch_profiler", "record_memory_history"):
        if hasattr(args, dest):
            setattr(out, dest, False)
    out.run_config = args.run_config.rebuilt(out)
    return out
