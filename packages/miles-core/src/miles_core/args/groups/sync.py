"""How weights travel from the trainer to the engines (implemented by miles-sync).

The transfer mode is decided by placement when not given: ``ipc`` when ``--colocate`` (the engine
shares the device, so CUDA IPC handles cross and no bytes do), ``broadcast`` otherwise. ``ipc``
needs ``--colocate``; ``broadcast``, ``p2p`` and ``disk-delta`` are for disaggregated runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from miles_core.args.checks import at_least, flag_value, option
from miles_core.args.flags import ArgGroup, ArgumentError, flag
from miles_core.args.parsed import ParsedArgs

TransferMode = Literal["ipc", "broadcast", "p2p", "disk-delta"]


def transfer_mode(args: ParsedArgs) -> str:
    """``--update-weight-transfer-mode`` as given, else ``ipc`` colocated, ``broadcast`` not."""
    if args.update_weight_transfer_mode is not None:
        return args.update_weight_transfer_mode
    return "ipc" if args.colocate else "broadcast"


@dataclass(frozen=True)
class SyncArgs(ArgGroup):
    title: ClassVar[str] = "weight sync"

    update_weight_transfer_mode: TransferMode | None = flag(
        None,
        common=True,
        help="How weights reach the engines. Unset: ipc with --colocate, else broadcast. "
        "p2p: every trainer rank sends its share; disk-delta: changed tensors through "
        "--update-weight-disk-dir.",
    )
    update_weight_buffer_size: int = flag(
        512 * 1024**2, metavar="BYTES", help="Largest bucket of flattened weights, in bytes."
    )
    pause_generation_mode: Literal["retract", "abort", "in_place"] = flag(
        "retract", help="How the engines pause generation while weights are replaced."
    )
    update_weight_disk_dir: str | None = flag(
        None,
        metavar="DIR",
        help="Shared directory the disk-delta writer publishes weight_vNNNNNN/ versions into.",
    )
    update_weight_local_checkpoint_dir: str | None = flag(
        None,
        metavar="DIR",
        help="Engine-local directory where the disk-delta puller keeps the decoded checkpoint.",
    )
    update_weight_delta_encoding: Literal["xor", "overwrite"] = flag(
        "xor", help="disk-delta encoding of a changed tensor (then zstd-compressed)."
    )
    update_weight_delta_checksum: Literal["xxh3-128", "blake3", "adler32"] = flag(
        "xxh3-128", help="disk-delta checksum of each new state."
    )

    update_weight_verify: bool = flag(
        False,
        help="After each publish, read every published tensor back from each engine "
        "(/get_weights_by_name) and fail the publish unless it equals the trainer's bit for bit. "
        "A debugging check: one JSON reply of every tensor per engine.",
    )

    @classmethod
    def validate(cls, args: ParsedArgs) -> None:
        at_least(args, "update_weight_buffer_size", 1)
        mode = transfer_mode(args)
        if mode == "ipc" and not args.colocate:
            raise ArgumentError("--update-weight-transfer-mode ipc requires --colocate")
        if args.colocate and mode != "ipc":
            raise ArgumentError(
                f"--update-weight-transfer-mode {mode} is for disaggregated runs, not "
                "--colocate (colocated runs publish over ipc)"
            )
        if mode == "disk-delta" and not args.update_weight_disk_dir:
            raise ArgumentError(
                "--update-weight-transfer-mode disk-delta requires --update-weight-disk-dir"
            )
        for dest in ("update_weight_disk_dir", "update_weight_local_checkpoint_dir"):
            if flag_value(args, dest) is not None and mode != "disk-delta":
                raise ArgumentError(
                    f"{option(dest)} is used only with --update-weight-transfer-mode disk-delta"
                )

    @classmethod
    def resolve_defaults(cls, args: ParsedArgs) -> None:
        args.update_weight_transfer_mode = transfer_mode(args)
