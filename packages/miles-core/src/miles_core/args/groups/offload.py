"""Where the paused trainer and its optimizer state live: sleep/wake targets and streamed Adam.

``--offload-train`` / ``--offload-rollout`` are tri-state: unset, they follow ``--colocate``
(:func:`offload_train_on`); after parsing they are plain booleans.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from miles_core.args.checks import at_least, exclusive
from miles_core.args.flags import ArgGroup, ArgumentError, flag
from miles_core.args.parsed import ParsedArgs


def offload_train_on(args: ParsedArgs) -> bool:
    """``--offload-train`` as given, else ``--colocate``."""
    return bool(args.colocate) if args.offload_train is None else bool(args.offload_train)


def offload_rollout_on(args: ParsedArgs) -> bool:
    """``--offload-rollout`` as given, else ``--colocate``."""
    return bool(args.colocate) if args.offload_rollout is None else bool(args.offload_rollout)


@dataclass(frozen=True)
class OffloadArgs(ArgGroup):
    title: ClassVar[str] = "offload"

    offload_train: bool | None = flag(
        None,
        common=True,
        help="Put the trainer to sleep (device memory freed) during generation. Unset: on "
        "with --colocate, off otherwise.",
    )
    offload_rollout: bool | None = flag(
        None,
        common=True,
        help="Release the engines' memory during training. Unset: on with --colocate, off "
        "otherwise.",
    )
    offload_train_target: Literal["cpu", "disk"] = flag(
        "cpu",
        common=True,
        help="Where the sleeping trainer goes: pinned host memory, or files under "
        "--offload-train-disk-dir (disk requires --offload-train).",
    )
    offload_train_disk_dir: str | None = flag(
        None,
        metavar="DIR",
        help="Directory for the disk target and streamed optimizer state (unset: under the "
        "temp dir).",
    )
    offload_train_disk_chunk_mb: int = flag(
        256, metavar="MB", help="Size of each pinned staging chunk between device and disk."
    )
    rematerialize_param_from_master_weight: bool = flag(
        False,
        help="Drop the parameter backup while asleep and rebuild it from the fp32 master "
        "weights (requires --colocate and --offload-train-target cpu).",
    )
    optimizer_cpu_offload: bool = flag(
        False, help="Keep optimizer state on the CPU and step there (Megatron backend)."
    )
    stream_optimizer_state_to_disk: bool = flag(
        False,
        help="Keep fp32 masters and Adam moments in files under --offload-train-disk-dir, "
        "streamed bucket by bucket during the step.",
    )
    stream_optimizer_state_moment_dtype: Literal["fp32", "bf16"] = flag(
        "fp32",
        help="Dtype of streamed Adam moments (fp32: bit-identical to in-memory AdamW; bf16: "
        "8 instead of 12 bytes per parameter).",
    )
    stream_optimizer_min_numel: int = flag(
        65536,
        help="Parameters with fewer elements keep an ordinary on-device AdamW.",
    )
    stream_optimizer_bucket_numel: int = flag(
        200_000_000, help="Elements per streamed optimizer bucket (at most 3 resident)."
    )

    @classmethod
    def validate(cls, args: ParsedArgs) -> None:
        at_least(args, "offload_train_disk_chunk_mb", 1)
        at_least(args, "stream_optimizer_min_numel", 0)
        at_least(args, "stream_optimizer_bucket_numel", 1)
        train_on = offload_train_on(args)
        if args.offload_train_target == "disk" and not train_on:
            raise ArgumentError(
                "--offload-train-target disk requires --offload-train (on by default with "
                "--colocate)"
            )
        if args.rematerialize_param_from_master_weight:
            if not args.colocate:
                raise ArgumentError("--rematerialize-param-from-master-weight requires --colocate")
            if args.offload_train_target != "cpu":
                raise ArgumentError(
                    "--rematerialize-param-from-master-weight requires --offload-train-target cpu"
                )
        if args.stream_optimizer_state_to_disk:
            exclusive(args, "stream_optimizer_state_to_disk", "optimizer_cpu_offload")
            exclusive(args, "stream_optimizer_state_to_disk", "use_lora")
            if train_on and args.offload_train_target != "disk":
                raise ArgumentError(
                    "--stream-optimizer-state-to-disk under --offload-train requires "
                    "--offload-train-target disk"
                )
        uses_disk = args.offload_train_target == "disk" or args.stream_optimizer_state_to_disk
        if args.offload_train_disk_dir is not None and not uses_disk:
            raise ArgumentError(
                "--offload-train-disk-dir is used only with --offload-train-target disk or "
                "--stream-optimizer-state-to-disk"
            )

    @classmethod
    def resolve_defaults(cls, args: ParsedArgs) -> None:
        args.offload_train = offload_train_on(args)
        args.offload_rollout = offload_rollout_on(args)
