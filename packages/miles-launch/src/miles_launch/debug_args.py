"""``--save-debug-rollout-data`` / ``--load-debug-rollout-data``: the launcher's debugging flags
(``launch`` entry point, with :mod:`miles_launch.args`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from miles_core.args import ArgGroup, ArgumentError, flag
from miles_core.args.checks import exclusive, flag_value, option
from miles_core.args.parsed import ParsedArgs

#: Flags that start or drive engines, refused with --load-debug-rollout-data (which has none).
REPLAY_REFUSES = (
    "colocate",
    "rollout_num_gpus",
    "sglang_router_ip",
    "fully_async",
    "eval_interval",
    "offload_train",
    "offload_rollout",
)


@dataclass(frozen=True)
class DebugDataArgs(ArgGroup):
    title: ClassVar[str] = "debugging"

    save_debug_rollout_data: str | None = flag(
        None,
        metavar="PATH",
        help="Save each rollout's training data (the batch train receives) to PATH, with "
        "{rollout_id} replaced by the rollout's id (e.g. /tmp/run/rollout_{rollout_id}.pt).",
    )
    load_debug_rollout_data: str | None = flag(
        None,
        metavar="PATH",
        help="Train on the rollouts a --save-debug-rollout-data PATH run saved instead of "
        "generating them: no engines start; each step is bitwise the saving run's.",
    )

    @classmethod
    def validate(cls, args: ParsedArgs) -> None:
        # miles_launch.rollout.debug_data is off the CLI's parse path
        from miles_launch.rollout.debug_data import DebugDataError, check_template

        exclusive(args, "save_debug_rollout_data", "load_debug_rollout_data")
        for dest in ("save_debug_rollout_data", "load_debug_rollout_data"):
            template = flag_value(args, dest)
            if template is not None:
                try:
                    check_template(option(dest), template)
                except DebugDataError as error:
                    raise ArgumentError(str(error)) from None
        save = args.save_debug_rollout_data
        if save and args.num_rollout > 1 and "{rollout_id}" not in save:
            raise ArgumentError(
                f"--save-debug-rollout-data {save}: no {{rollout_id}} in the path, so each of "
                f"the {args.num_rollout} rollouts would overwrite the last"
            )
        if args.load_debug_rollout_data:
            for dest in REPLAY_REFUSES:
                if dest in args.explicit_flags:
                    raise ArgumentError(
                        f"--load-debug-rollout-data replays saved rollouts without engines: "
                        f"{option(dest)} cannot be used with it"
                    )

    @classmethod
    def resolve_defaults(cls, args: ParsedArgs) -> None:
        if args.load_debug_rollout_data:
            args.rollout_num_gpus = 0  # no engines (see miles_launch.replay)

    @classmethod
    def check_paths(cls, args: ParsedArgs) -> None:
        # miles_launch.rollout.debug_data is off the CLI's parse path
        from miles_launch.rollout.debug_data import data_path

        template = args.load_debug_rollout_data
        if not template:
            return
        # A resumed run (--load) needs only the rollouts after its checkpoint: the last one is
        # checked here, the others when they are trained.
        ids = [args.num_rollout - 1] if args.load else range(args.num_rollout)
        for rollout_id in ids:
            path = data_path(template, rollout_id)
            if not path.is_file():
                raise ArgumentError(
                    f"--load-debug-rollout-data {template}: {path} (rollout {rollout_id}) "
                    "does not exist"
                )
