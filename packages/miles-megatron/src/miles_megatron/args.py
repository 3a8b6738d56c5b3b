"""The Megatron backend's own flags, its validation, and the group list of its entry point.

``megatron_groups()`` (the ``miles.arg_groups`` entry point ``megatron``) returns, in order:
:class:`MegatronArgs`, :class:`~miles_megatron.arch_args.ArchitectureArgs` and the groups
generated from megatron-core's config dataclasses (:mod:`miles_megatron.generated_flags`).
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from miles_core.args import ArgGroup, ArgumentError, flag
from miles_core.args.checks import flag_value, launch_world_size
from miles_core.args.checks import option as flag_option
from miles_core.args.groups.offload import offload_train_on
from miles_core.args.parsed import ParsedArgs
from miles_core.precision import train_dtype_name

from miles_megatron.arch_args import (
    ArchitectureArgs,
    explicit_arch_args,
    resolve_model_args,
    transformer_engine_available,
)
from miles_megatron.generated_flags import check_generated_flags, generated_groups, generated_value
from miles_megatron.layout_kinds import check_layout_kind

#: the values the Megatron backend honours
ATTN_IMPLEMENTATIONS = ("varlen", "sdpa")


def check_attn_implementation(args: ParsedArgs) -> None:
    """Argument time: a value the Megatron backend cannot honour, and varlen with CP > 1."""
    value = args.attn_implementation
    if value is None:
        return
    if value not in ATTN_IMPLEMENTATIONS:
        raise ArgumentError(
            f"--attn-implementation {value}: the Megatron backend attends packed rows with "
            "varlen (torch's varlen flash kernel) or sdpa (SDPA with a block mask)"
        )
    cp = args.context_parallel_size
    if value == "varlen" and cp > 1:
        raise ArgumentError(
            f"--attn-implementation varlen with --context-parallel-size {cp}: context "
            "parallelism attends through the masked path (--attn-implementation sdpa)"
        )


@dataclass(frozen=True)
class MegatronArgs(ArgGroup):
    title: ClassVar[str] = "Megatron backend"

    spec: list[str] | None = flag(
        None,
        metavar="MODULE FUNCTION",
        common=True,
        help="Custom layer spec: FUNCTION(args, config, vp_stage) in MODULE returns a ModuleSpec.",
    )
    sequence_parallel: bool = flag(
        False, common=True, help="Sequence parallelism inside TP groups (recommended with TP > 1)."
    )
    custom_megatron_init_path: str | None = flag(
        None,
        metavar="MODULE:FUNC",
        help="module:function called as f(args, model, optimizer) after the model is built.",
    )
    custom_megatron_before_log_prob_hook_path: str | None = flag(
        None,
        metavar="MODULE:FUNC",
        help="module:function called as f(args, model, batch) before each log-prob pass.",
    )
    custom_megatron_before_train_step_hook_path: str | None = flag(
        None,
        metavar="MODULE:FUNC",
        help="module:function called as f(args, rollout_id, step, model, optimizer) "
        "before each optimizer step's forward/backward.",
    )
    ref_update_interval: int | None = flag(
        None, help="Copy the actor into the reference model every N rollouts (unset: never)."
    )
    use_distributed_optimizer: bool = flag(
        True,
        help="Accepted for Megatron-LM recipes: the distributed optimizer is always on "
        "(a no-op; --no-use-distributed-optimizer is refused).",
    )
    transformer_impl: str | None = flag(
        None,
        help="Layer implementation: only 'local' (megatron-core's local spec, the one the "
        "bridge maps; also the default). transformer_engine is refused.",
    )
    publish_lora_adapter: bool = flag(
        False,
        help="With --use-lora, publish the adapter's PEFT-named factors (engines that load "
        "LoRA) instead of the merged weights.",
    )

    @classmethod
    def validate(cls, args: ParsedArgs) -> None:
        if args.critic_hf_checkpoint:
            raise ArgumentError(
                "--critic-hf-checkpoint is not supported by the Megatron backend yet (its critic "
                "shares the actor's architecture flags); use --train-backend fsdp"
            )
        if not args.use_distributed_optimizer:
            raise ArgumentError(
                "--no-use-distributed-optimizer: the Megatron backend always uses the "
                "distributed optimizer"
            )
        if args.transformer_impl not in (None, "local"):
            raise ArgumentError(
                f"--transformer-impl {args.transformer_impl}: only 'local' is supported (the "
                "backend builds megatron-core's local spec, whose parameter names the bridge maps)"
            )
        check_recompute_flags(args)
        if args.spec is not None and len(args.spec) != 2:
            raise ArgumentError("--spec takes two values: MODULE FUNCTION")
        if args.publish_lora_adapter and not args.use_lora:
            raise ArgumentError("--publish-lora-adapter requires --use-lora")
        if args.ref_update_interval is not None and args.ref_update_interval < 1:
            raise ArgumentError("--ref-update-interval must be >= 1")
        tp = args.tensor_model_parallel_size
        if tp > 1 and not args.sequence_parallel:
            warnings.warn(
                "--tensor-model-parallel-size > 1 without --sequence-parallel: activations are "
                "replicated across the TP group (pass --sequence-parallel unless the recipe says "
                "otherwise)",
                stacklevel=2,
            )
        check_not_honoured(args)
        check_lora_and_reference_flags(args)
        check_generated_flags(args)
        check_context_parallel_flags(args)
        check_routing_replay_flags(args)
        check_attn_implementation(args)
        check_memory_flags(args)
        world = world_size_of(args)
        check_parallel_sizes(args, world, model_args=None)
        if args.num_attention_heads is not None and args.num_attention_heads % tp:
            raise ArgumentError(
                f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                f"--tensor-model-parallel-size {tp}"
            )

    @classmethod
    def preflight(cls, args: ParsedArgs) -> None:
        """The job's driver: ``--ref-load`` is an HF directory or a checkpoint of this backend;
        megatron-core puts its buffers, RNG trackers and streams on the current CUDA device, so
        a machine whose torch answers no ``torch.cuda.current_device()`` cannot run it (checked
        when the ranks run here: not with ``--ray-address``, whose nodes the driver's machine
        says nothing about)."""
        import torch  # torch stays off the CLI's parse path (test_cli_help)

        check_ref_load(args)
        if "ray_address" in args and args.ray_address:  # the launcher's flag (its group parsed)
            return  # the ranks run on the cluster's nodes, not on the driver's machine
        try:
            torch.cuda.current_device()
        except (AssertionError, RuntimeError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            default = "" if "train_backend" in args.explicit_flags else " (the default)"
            raise ArgumentError(
                f"--train-backend megatron{default} needs a CUDA device, and this machine has "
                f"none (torch {torch.__version__}: {reason}); pass --train-backend fsdp, which "
                "trains on the CPU"
            ) from None

    @classmethod
    def check_paths(cls, args: ParsedArgs) -> None:
        # the architecture is checked when one is described (the backend's init requires it)
        from miles_megatron.bridge import BridgeError

        if args.hf_checkpoint or explicit_arch_args(args):
            try:
                margs = resolve_model_args(args)
            except BridgeError as exc:
                raise ArgumentError(str(exc)) from exc
            check_parallel_sizes(args, world_size_of(args), model_args=margs)
            world = launch_world_size(args)
            if world is not None:  # a job's layout: its kind is proven or refused
                check_layout_kind(args, world, moe=bool(margs.get("num_experts")))


def check_ref_load(args: ParsedArgs) -> None:
    """``--ref-load`` holds what :meth:`ReferenceModel.load` reads: an HF directory
    (config.json) or a committed checkpoint of this backend (a tracker naming an iteration)."""

    # miles_core.checkpoint_layout is off the CLI's parse path
    from miles_core.checkpoint_layout import CheckpointError, resolve_load

    ref = args.ref_load
    if not ref or (Path(ref) / "config.json").is_file():
        return
    try:
        resolved = resolve_load(ref)
    except CheckpointError as exc:
        raise ArgumentError(f"--ref-load {ref}: {exc}") from None
    if resolved is None:
        raise ArgumentError(
            f"--ref-load {ref}: neither an HF model (no config.json) nor a checkpoint (no "
            "latest_checkpointed_iteration.txt); point it at one"
        )
    if resolved.meta.backend != "megatron":
        raise ArgumentError(
            f"--ref-load {ref}: iteration {resolved.iteration} was written by the "
            f"{resolved.meta.backend} backend, which the megatron backend cannot read; point "
            "--ref-load at an HF model directory"
        )


_HOOKS = "only the FSDP backend runs the custom prepare hook and the teacher"
#: Shared flags the Megatron backend does not read, with the reason: refused at argument time.
NOT_HONOURED = (
    ("teacher_load", _HOOKS),
    ("custom_prepare_path", _HOOKS),
    (
        "ref_lora_adapter_path",
        "its reference is --ref-load's weights or, with --ref-mode lora_base, the actor without "
        "its adapters",
    ),
    (
        "use_ema",
        "it keeps no EMA of the actor: --rollout-weights, --eval-weights and --old-policy ema "
        "need the FSDP backend",
    ),
    (
        "true_on_policy",
        "its forward has no batch-invariant kernels; the FSDP backend with the built-in engine "
        "runs the mode on CPU",
    ),
)


def check_not_honoured(args: ParsedArgs) -> None:
    """Refuse the shared flags only the FSDP backend reads (the custom prepare hook and the
    teacher, the EMA) and more than one ``--update-weight-target-module`` name."""
    for dest, why in NOT_HONOURED:
        if flag_value(args, dest):
            raise ArgumentError(
                f"{flag_option(dest)} is not honoured by --train-backend megatron ({why})"
            )
    names = args.update_weight_target_module or []
    if len(names) > 1:
        raise ArgumentError(
            f"--update-weight-target-module: the Megatron backend trains a causal LM, one "
            f"component, got {len(names)} ({', '.join(names)})"
        )


def check_lora_and_reference_flags(args: ParsedArgs) -> None:
    """What the Megatron backend's LoRA and reference model do not cover, refused before any rank
    starts (they were found only at the backend's init)."""
    if args.use_lora and not args.hf_checkpoint:
        raise ArgumentError("--use-lora needs --hf-checkpoint (the frozen base weights)")
    if args.use_lora and args.pipeline_model_parallel_size > 1:
        raise ArgumentError(
            f"--use-lora with --pipeline-model-parallel-size {args.pipeline_model_parallel_size}"
            " is not supported by --train-backend megatron yet (adapter export and "
            "--publish-lora-adapter cover one stage)"
        )
    if args.kl_coef > 0 and args.ref_mode != "ref":
        raise ArgumentError(
            f"--kl-coef {args.kl_coef} under --train-backend megatron needs a reference model "
            "(--ref-load)"
        )


def check_routing_replay_flags(args: ParsedArgs) -> None:
    """``--use-rollout-routing-replay``: refuse the layouts :mod:`miles_megatron.routing_replay`
    does not cover (a split row's tokens, a micro-batch's backward away from its forward)."""
    if not args.use_rollout_routing_replay:
        return
    for dest, limit in (
        ("context_parallel_size", "splits a row's tokens over CP ranks"),
        (
            "pipeline_model_parallel_size",
            "runs other micro-batches between a forward and its backward",
        ),
    ):
        size = flag_value(args, dest)
        if size > 1:
            raise ArgumentError(
                f"--use-rollout-routing-replay with {flag_option(dest)} {size} is not supported "
                f"by --train-backend megatron (it {limit})"
            )
    if args.tensor_model_parallel_size > 1 and args.sequence_parallel:
        raise ArgumentError(
            "--use-rollout-routing-replay with --sequence-parallel is not supported by "
            "--train-backend megatron (it splits a row's tokens over TP ranks)"
        )


def check_context_parallel_flags(args: ParsedArgs) -> None:
    """``--context-parallel-size > 1``: refuse what its attention and loss split do not cover
    (:mod:`miles_megatron.context_parallel`)."""
    cp = args.context_parallel_size
    if cp <= 1:
        return
    if args.spec is not None:
        raise ArgumentError(
            f"--context-parallel-size {cp} with --spec: context parallelism attends through "
            "the local spec's SDPA attention only"
        )
    if args.advantage_estimator == "gspo":
        raise ArgumentError(
            f"--context-parallel-size {cp} with --advantage-estimator gspo: GSPO's sequence "
            "ratio is not a sum over tokens, which CP ranks hold parts of"
        )
    if args.use_tis and args.tis_level != "token":
        raise ArgumentError(
            f"--context-parallel-size {cp} with --tis-level {args.tis_level}: a sequence's "
            "importance weight needs all its tokens, which CP ranks hold parts of"
        )
    if args.custom_loss_function_path:
        raise ArgumentError(
            f"--context-parallel-size {cp} with --custom-loss-function-path: the hook gets a "
            "whole packed row, which CP ranks hold parts of"
        )
    if args.use_opsm:
        raise ArgumentError(
            f"--context-parallel-size {cp} with --use-opsm: a sample's mean log-ratio needs all "
            "its tokens, which CP ranks hold parts of"
        )
    if args.use_lora:
        raise ArgumentError(f"--context-parallel-size {cp} with --use-lora is not supported yet")


def check_memory_flags(args: ParsedArgs) -> None:
    """The megatron-specific rules of the memory flags (miles-core's offload group checks the
    rest: ``--rematerialize-param-from-master-weight`` needs ``--colocate`` and the cpu target,
    ``--stream-optimizer-state-to-disk`` excludes ``--optimizer-cpu-offload``)."""
    precision_aware = bool(generated_value(args, "use_precision_aware_optimizer"))
    if args.rematerialize_param_from_master_weight:
        if precision_aware:
            raise ArgumentError(
                "--rematerialize-param-from-master-weight excludes --use-precision-aware-optimizer"
            )
        if not offload_train_on(args):
            raise ArgumentError("--rematerialize-param-from-master-weight requires --offload-train")
    if precision_aware and not transformer_engine_available():
        raise ArgumentError(
            "--use-precision-aware-optimizer needs TransformerEngine, which is not installed"
        )
    if args.optimizer_cpu_offload and train_dtype_name(args) == "fp32":
        raise ArgumentError(
            "--optimizer-cpu-offload needs --bf16 or --fp16, not --no-bf16 (megatron-core's "
            "HybridDeviceOptimizer cannot take fp32 parameters' shards)"
        )
    if generated_value(args, "overlap_cpu_optimizer_d2h_h2d") and not args.optimizer_cpu_offload:
        raise ArgumentError("--overlap-cpu-optimizer-d2h-h2d requires --optimizer-cpu-offload")
    fraction = generated_value(args, "optimizer_offload_fraction")
    if fraction is not None and not 0.0 <= fraction <= 1.0:
        raise ArgumentError(f"--optimizer-offload-fraction must be in [0, 1], got {fraction}")


def check_recompute_flags(args: ParsedArgs) -> None:
    """megatron-core's recompute rules, at argument time (TransformerConfig asserts them at init)."""
    granularity = generated_value(args, "recompute_granularity")
    method = generated_value(args, "recompute_method")
    num_layers = generated_value(args, "recompute_num_layers")
    if granularity == "full" and (method is None or num_layers is None):
        raise ArgumentError(
            "--recompute-granularity full needs --recompute-method and --recompute-num-layers"
        )
    if granularity == "selective" and num_layers is not None:
        raise ArgumentError("--recompute-granularity selective takes no --recompute-num-layers")


def world_size_of(args: ParsedArgs) -> int | None:
    """The trainer's world size when known at argument time (launcher flags or WORLD_SIZE)."""
    world = launch_world_size(args)
    if world is not None:
        return world
    env = os.environ.get("WORLD_SIZE")
    return int(env) if env else None


def check_parallel_sizes(args: ParsedArgs, world_size: int | None, model_args: dict | None) -> None:
    """Reject parallel layouts megatron-core cannot build; errors name the flags.

    ``world_size`` None skips the divisibility of the world; ``model_args`` None skips the
    checks against the architecture.
    """
    tp = args.tensor_model_parallel_size
    pp = args.pipeline_model_parallel_size
    cp = args.context_parallel_size
    ep = args.expert_model_parallel_size
    etp = args.expert_tensor_parallel_size or tp
    if world_size is not None:
        if world_size % (tp * pp * cp):
            raise ArgumentError(
                f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
                f"--pipeline-model-parallel-size {pp} x --context-parallel-size {cp}"
            )
        if world_size % (etp * ep * pp):
            raise ArgumentError(
                f"world size {world_size} is not divisible by --expert-tensor-parallel-size {etp}"
                f" x --expert-model-parallel-size {ep} x --pipeline-model-parallel-size {pp}"
            )
    if etp not in (1, tp):
        raise ArgumentError(
            f"--expert-tensor-parallel-size {etp} with --tensor-model-parallel-size {tp}: "
            f"supported are 1 and {tp} (at ETP > TP expert gradients differ from HF's)"
        )
    if model_args is None:
        return
    heads, groups = model_args["num_attention_heads"], model_args["num_query_groups"]
    if heads % tp:
        raise ArgumentError(
            f"attention heads ({heads}) not divisible by --tensor-model-parallel-size {tp}"
        )
    if groups % tp:
        raise ArgumentError(
            f"query groups ({groups}) not divisible by --tensor-model-parallel-size {tp}"
        )
    experts = model_args.get("num_experts")
    if experts and cp > 1:
        raise ArgumentError(
            f"--context-parallel-size {cp} on an MoE model ({experts} experts) is not supported "
            "yet (dense models only)"
        )
    if not experts and ep > 1:
        raise ArgumentError("--expert-model-parallel-size on a dense model (no --num-experts)")
    if experts and tp > 1 and not args.sequence_parallel:
        raise ArgumentError(
            "MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel (megatron-core)"
        )
    if experts and experts % ep:
        raise ArgumentError(
            f"experts ({experts}) not divisible by --expert-model-parallel-size {ep}"
        )
    if model_args["num_layers"] % pp:
        raise ArgumentError(
            f"layers ({model_args['num_layers']}) not divisible by "
            f"--pipeline-model-parallel-size {pp}"
        )


@functools.cache
def megatron_groups() -> list[type[ArgGroup]]:
    """The ``megatron`` entry point's groups: own flags, architecture, generated."""
    own = [MegatronArgs, ArchitectureArgs]
    return [*own, *generated_groups(own)]
