"""Model roles: the KL reference, the teacher, LoRA adapters and EMA.

``--ref-mode`` is decided by other flags when not given (:func:`derived_ref_mode`): ``ref`` when
``--ref-load`` is given, else ``lora_base`` when a KL term is on and ``--use-lora``, else ``none``.
A model is a dict of named components (``--update-weight-target-module``; unset: one component,
the model); every per-component flag (the adapter paths) takes exactly one value per component.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from miles_core.args.checks import at_least, flag_value, greater_than, option, requires, within
from miles_core.args.flags import ArgGroup, ArgumentError, flag
from miles_core.args.groups.algorithm import kl_term_on
from miles_core.args.parsed import ParsedArgs

#: Flags that take one value per component of --update-weight-target-module.
PER_COMPONENT_DESTS = ("lora_adapter_path", "ref_lora_adapter_path", "teacher_lora_adapter_path")

#: (flag, value) pairs that consume EMA weights; --use-ema needs one of them.
EMA_CONSUMERS = (("rollout_weights", "ema"), ("eval_weights", "ema"), ("old_policy", "ema"))


def derived_ref_mode(args: ParsedArgs) -> str:
    """The reference mode when ``--ref-mode`` is not given."""
    if args.ref_load:
        return "ref"
    if kl_term_on(args) and args.use_lora:
        return "lora_base"
    return "none"


def num_components(args: ParsedArgs) -> int:
    """Number of model components: entries of --update-weight-target-module, or 1."""
    return len(args.update_weight_target_module) if args.update_weight_target_module else 1


@dataclass(frozen=True)
class RolesArgs(ArgGroup):
    title: ClassVar[str] = "model roles: reference, teacher, LoRA, EMA"

    ref_load: str | None = flag(
        None,
        metavar="DIR",
        common=True,
        help="Independent frozen reference model (implies --ref-mode ref).",
    )
    ref_mode: Literal["none", "lora_base", "ref"] | None = flag(
        None,
        help="KL reference: none, lora_base (the actor with its adapter disabled) or ref "
        "(--ref-load). Unset: ref with --ref-load, else lora_base when a KL term is on with "
        "--use-lora, else none.",
    )
    ref_lora_adapter_path: list[str] | None = flag(
        None, metavar="DIR", help="PEFT adapter directories of the reference, one per component."
    )
    ref_cpu_offload: bool = flag(False, help="Keep the reference's shards on the CPU.")
    teacher_load: str | None = flag(
        None,
        metavar="DIR",
        common=True,
        help="Frozen teacher model, read by custom prepare/loss hooks (needs one of them).",
    )
    teacher_lora_adapter_path: list[str] | None = flag(
        None, metavar="DIR", help="PEFT adapter directories of the teacher, one per component."
    )
    teacher_cpu_offload: bool = flag(False, help="Keep the teacher's shards on the CPU.")
    use_lora: bool = flag(
        False, common=True, help="Train LoRA adapters (PEFT) instead of the full model."
    )
    lora_rank: int = flag(16, common=True, help="LoRA rank r (must equal a loaded adapter's r).")
    lora_alpha: float = flag(
        32.0, help="LoRA alpha; scale alpha / r (must equal a loaded adapter's lora_alpha)."
    )
    lora_dropout: float = flag(0.0, help="LoRA dropout probability.")
    lora_target_modules: list[str] = flag(
        ["all-linear"], help="Module names LoRA wraps (PEFT target_modules; 'all-linear')."
    )
    lora_adapter_path: list[str] | None = flag(
        None,
        metavar="DIR",
        help="PEFT adapter directories to start the actor from, one per component.",
    )
    use_ema: bool = flag(False, help="Keep an EMA of the trainable actor parameters.")
    ema_decay_init: float = flag(
        0.001, help="EMA decay for the first --ema-decay-flat-steps steps."
    )
    ema_decay_ramp: float = flag(
        0.001, help="EMA decay growth per optimizer step after the flat phase."
    )
    ema_decay_max: float = flag(0.5, help="Upper bound of the EMA decay.")
    ema_decay_flat_steps: int = flag(0, help="Optimizer steps that use --ema-decay-init.")
    rollout_weights: Literal["actor", "ema"] = flag(
        "actor", help="Weights published to the engines (ema requires --use-ema)."
    )
    eval_weights: Literal["actor", "ema"] = flag(
        "actor", help="Weights evaluated with (ema requires --use-ema)."
    )
    old_policy: Literal["actor", "ema"] = flag(
        "actor",
        help="Policy the PPO ratio is taken against: the actor before the update, or EMA.",
    )
    update_weight_target_module: list[str] | None = flag(
        None,
        metavar="NAME",
        help="Model components trained and published (unset: the model as one component).",
    )
    custom_prepare_path: str | None = flag(
        None, metavar="MODULE:FUNC", help="Hook that prepares model inputs (gets the roles)."
    )
    custom_loss_function_path: str | None = flag(
        None,
        metavar="MODULE:FUNC",
        help="The actor's loss in place of --loss-type policy_loss (docs/rl-math.md).",
    )

    @classmethod
    def validate(cls, args: ParsedArgs) -> None:
        mode = args.ref_mode
        if mode is not None and mode != "ref" and args.ref_load:
            raise ArgumentError(f"--ref-load needs --ref-mode ref (or no --ref-mode), not {mode}")
        if mode == "ref" and not args.ref_load:
            raise ArgumentError("--ref-mode ref requires --ref-load")
        requires(args, "ref_lora_adapter_path", "ref_load")
        requires(args, "ref_cpu_offload", "ref_load")
        if mode == "lora_base" and not args.use_lora:
            raise ArgumentError("--ref-mode lora_base requires --use-lora")
        effective = mode if mode is not None else derived_ref_mode(args)
        if effective == "none" and kl_term_on(args):
            given = "ref_mode" in args.explicit_flags
            how = "--ref-mode none" if given else "no --ref-load (and no --use-lora)"
            raise ArgumentError(
                f"a KL term (--use-kl-loss or --kl-coef > 0) needs a reference, but {how}: "
                "pass --ref-load, or --use-lora with --ref-mode lora_base"
            )

        if args.teacher_load and not (args.custom_prepare_path or args.custom_loss_function_path):
            raise ArgumentError(
                "--teacher-load has no built-in consumer: it requires --custom-prepare-path "
                "or --custom-loss-function-path"
            )
        loss_type = args.loss_type
        if args.custom_loss_function_path and loss_type != "policy_loss":
            raise ArgumentError(
                f"--custom-loss-function-path replaces the actor's --loss-type policy_loss "
                f"(its batch carries the old and reference log-probs), not {loss_type}"
            )
        requires(args, "teacher_lora_adapter_path", "teacher_load")
        requires(args, "teacher_cpu_offload", "teacher_load")

        requires(args, "lora_adapter_path", "use_lora")
        at_least(args, "lora_rank", 1)
        greater_than(args, "lora_alpha", 0.0)
        if not 0.0 <= args.lora_dropout < 1.0:
            raise ArgumentError(f"--lora-dropout must be in [0, 1), got {args.lora_dropout}")
        components = num_components(args)
        if (
            args.update_weight_target_module
            and len(set(args.update_weight_target_module)) < components
        ):
            raise ArgumentError("--update-weight-target-module names a component twice")
        for dest in PER_COMPONENT_DESTS:
            values = flag_value(args, dest)
            if values is not None and len(values) != components:
                raise ArgumentError(
                    f"{option(dest)} takes one value per component "
                    f"(--update-weight-target-module: {components}), got {len(values)}"
                )

        for dest, value in EMA_CONSUMERS:
            if flag_value(args, dest) == value and not args.use_ema:
                raise ArgumentError(f"{option(dest)} {value} requires --use-ema")
        if args.use_ema and not any(flag_value(args, d) == v for d, v in EMA_CONSUMERS):
            raise ArgumentError(
                "--use-ema has no consumer: add --rollout-weights ema, --eval-weights ema "
                "or --old-policy ema"
            )
        within(args, "ema_decay_init", 0.0, 1.0)
        at_least(args, "ema_decay_ramp", 0.0)
        within(args, "ema_decay_max", 0.0, 1.0)
        at_least(args, "ema_decay_flat_steps", 0)

    @classmethod
    def resolve_defaults(cls, args: ParsedArgs) -> None:
        if args.ref_mode is None:
            args.ref_mode = derived_ref_mode(args)

    @classmethod
    def check_paths(cls, args: ParsedArgs) -> None:
        for dest in ("ref_load", "teacher_load", *PER_COMPONENT_DESTS):
            value = flag_value(args, dest)
            for path in value if isinstance(value, list) else [value] if value else []:
                if not Path(path).is_dir():
                    raise ArgumentError(f"{option(dest)} {path}: no such directory")

    @classmethod
    def preflight(cls, args: ParsedArgs) -> None:
        """The loss hook's signature (its second parameter names logits or scores), checked
        by the driver before any rank starts."""
        # miles_core.custom_loss is off the CLI's parse path
        from miles_core.custom_loss import LossHook

        LossHook.from_args(args)
