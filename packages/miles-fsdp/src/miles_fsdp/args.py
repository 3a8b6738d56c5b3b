"""Flags owned by the FSDP backend (the shared ones live in ``miles_core.args``)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from miles_core.args import ArgGroup, ArgumentError, flag
from miles_core.args.checks import flag_value, launch_world_size
from miles_core.args.parsed import ParsedArgs
from miles_core.precision import explicit_dtype_name

#: Shared flags this backend has no meaning for: refused at argument time, with the reason.
NOT_HONOURED = (
    (
        "optimizer_cpu_offload",
        "megatron-core's CPU optimizer; use --fsdp-cpu-offload for the optimizer step on the CPU",
    ),
    (
        "rematerialize_param_from_master_weight",
        "its sharded parameters are the fp32 masters: there is no separate backup to drop",
    ),
)

#: Model-parallel dimensions this backend does not have (all data parallel).
UNSUPPORTED_PARALLEL = (
    ("tensor_model_parallel_size", "--tensor-model-parallel-size"),
    ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
    ("context_parallel_size", "--context-parallel-size"),
    ("expert_model_parallel_size", "--expert-model-parallel-size"),
    ("expert_tensor_parallel_size", "--expert-tensor-parallel-size"),
)


def _trainer_world_size(args: ParsedArgs) -> int | None:
    """Number of trainer ranks when known at parse time (launcher placement or torchrun env)."""
    world = launch_world_size(args)
    if world is not None:
        return world
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


@dataclass
class FSDPArgs(ArgGroup):
    title: ClassVar[str] = "FSDP backend"

    dp_replicate_size: int = flag(
        1,
        metavar="N",
        help="Replicas of the sharded model (HSDP); dp_shard = world size / N shards within one.",
    )
    fsdp_cpu_offload: bool = flag(
        False,
        common=True,
        help="FSDP2 CPUOffloadPolicy: parameters, gradients and optimizer state in host memory; "
        "the optimizer step runs on the CPU.",
    )
    fsdp_cpu_backend: Literal["gloo"] = flag(
        "gloo", help="Process-group backend for CPU collectives of --fsdp-cpu-offload."
    )
    gradient_checkpointing: bool = flag(
        False,
        common=True,
        help="Recompute activations in backward (HF gradient checkpointing, non-reentrant).",
    )
    gradient_checkpointing_layers: int | None = flag(
        None,
        metavar="N",
        help="With --gradient-checkpointing: recompute only the first N decoder layers and keep "
        "the rest's activations (Megatron's --recompute-method block --recompute-num-layers N): "
        "less recompute where memory allows (unset: every layer).",
    )
    keep_fp32_master: bool = flag(
        True,
        help="Keep fp32 master weights and optimizer state (--no-keep-fp32-master holds them in "
        "the compute dtype to save memory).",
    )
    fsdp_compute_dtype: Literal["bf16", "fp16", "fp32"] | None = flag(
        None,
        help="The compute dtype when none of --bf16/--no-bf16/--fp16 is given (unset: bf16); "
        "refused when it contradicts them.",
    )
    moe_kernel: Literal["fused", "eager"] | None = flag(
        None,
        help="Expert kernels of MoE models (qwen3_moe, qwen3_5_moe, glm4_moe_lite): fused "
        "Triton kernels or transformers' eager loop (unset: fused on GPU, eager on CPU).",
    )
    use_pytorch_profiler: bool = flag(
        False, help="Trace optimizer steps --profile-step-start..end with torch.profiler."
    )
    profile_step_start: int = flag(2, help="First optimizer step traced by the profiler.")
    profile_step_end: int = flag(4, help="Optimizer step at which the profiler trace stops.")
    record_memory_history: bool = flag(
        False, help="Record CUDA allocator history and dump a snapshot (--memory-snapshot-path)."
    )
    memory_snapshot_path: str = flag(
        "memory_snapshot.pickle", metavar="PATH", help="Where the memory snapshot is written."
    )

    @classmethod
    def validate(cls, args: ParsedArgs) -> None:
        for dest, option in UNSUPPORTED_PARALLEL:
            size = flag_value(args, dest)
            if size is not None and size > 1:
                raise ArgumentError(
                    f"{option} {size}: the FSDP backend is data parallel only; "
                    "use --train-backend megatron for model parallelism"
                )
        if args.dp_replicate_size < 1:
            raise ArgumentError(f"--dp-replicate-size must be >= 1, got {args.dp_replicate_size}")
        world = _trainer_world_size(args)
        if world is not None and world % args.dp_replicate_size:
            raise ArgumentError(
                f"--dp-replicate-size {args.dp_replicate_size} does not divide the "
                f"{world} trainer ranks"
            )
        if args.fsdp_cpu_offload and args.stream_optimizer_state_to_disk:
            raise ArgumentError(
                "--stream-optimizer-state-to-disk and --fsdp-cpu-offload are mutually exclusive"
            )
        for dest, why in NOT_HONOURED:
            if flag_value(args, dest):
                raise ArgumentError(
                    f"--{dest.replace('_', '-')} is not honoured by --train-backend fsdp ({why})"
                )
        if args.true_on_policy and args.attn_implementation is not None:
            raise ArgumentError(
                f"--attn-implementation {args.attn_implementation} with --true-on-policy: the "
                "mode attends through its own batch-invariant attention (drop the flag)"
            )
        names = args.update_weight_target_module or []
        if len(names) > 1:
            raise ArgumentError(
                f"--update-weight-target-module: the FSDP backend trains a causal LM, one "
                f"component, got {len(names)} ({', '.join(names)})"
            )
        named = explicit_dtype_name(args)
        if args.fsdp_compute_dtype is not None and named not in (None, args.fsdp_compute_dtype):
            given = {"fp16": "--fp16", "bf16": "--bf16", "fp32": "--no-bf16"}[named]
            raise ArgumentError(
                f"--fsdp-compute-dtype {args.fsdp_compute_dtype} contradicts {given} "
                f"({named}); give one of them"
            )
        layers = args.gradient_checkpointing_layers
        if layers is not None:
            if not args.gradient_checkpointing:
                raise ArgumentError(
                    "--gradient-checkpointing-layers needs --gradient-checkpointing (without it "
                    "no layer is recomputed)"
                )
            if layers < 1:
                raise ArgumentError(f"--gradient-checkpointing-layers must be >= 1, got {layers}")
        if args.compile_decoder_layers and args.true_on_policy:
            raise ArgumentError(
                "--compile-decoder-layers with --true-on-policy: compiled kernels fuse and "
                "reorder the arithmetic the mode keeps identical to the engine's (drop one)"
            )
        compute = named or args.fsdp_compute_dtype or "bf16"
        if args.true_on_policy and compute == "fp16":
            raise ArgumentError(
                "--true-on-policy computes in bf16 (GPU) or fp32, and the compute dtype is fp16"
            )
        if args.profile_step_end <= args.profile_step_start:
            raise ArgumentError(
                f"--profile-step-end ({args.profile_step_end}) must exceed "
                f"--profile-step-start ({args.profile_step_start})"
            )

    @classmethod
    def preflight(cls, args: ParsedArgs) -> None:
        """The job's driver: the frozen roles load as HF models (:mod:`miles_fsdp.roles`), so
        ``--ref-load`` and ``--teacher-load`` must hold a config.json (the backend runs on
        the CPU too: no device check)."""

        layers = args.gradient_checkpointing_layers
        config = Path(args.hf_checkpoint or "") / "config.json"
        if layers is not None and args.hf_checkpoint and config.is_file():
            total = json.loads(config.read_text()).get("num_hidden_layers")
            if isinstance(total, int) and layers > total:
                raise ArgumentError(
                    f"--gradient-checkpointing-layers {layers}: the model has {total} decoder "
                    f"layers ({config})"
                )
        for flag_name in ("ref_load", "teacher_load"):
            path = flag_value(args, flag_name)
            if path and not (Path(path) / "config.json").is_file():
                option = "--" + flag_name.replace("_", "-")
                raise ArgumentError(
                    f"{option} {path}: no config.json; the FSDP backend loads this role from an "
                    "HF model directory (a miles checkpoint is not read here)"
                )


def fsdp_groups() -> list[type[ArgGroup]]:
    """The ``miles.arg_groups`` entry point of the FSDP backend."""
    return [FSDPArgs]
