"""``miles-sync``: the engine-side tools of weight sync.

``miles-sync pull --update-weight-disk-dir SHARED --update-weight-local-checkpoint-dir LOCAL
--engine-url http://127.0.0.1:30000`` runs the disk-delta puller beside one engine (see
:mod:`miles_sync.puller`); ``--once`` brings the local checkpoint up to date and exits (status 1
when the newest version was refused).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass
from typing import Any, ClassVar

from miles_core.args import ArgGroup, ArgumentError, flag, parse_args_or_exit
from miles_core.args.flags import FLAG_METADATA_KEY
from miles_core.args.groups.sync import SyncArgs
from miles_core.args.parsed import ParsedArgs

USAGE = """usage: miles-sync <command> [flags]

commands:
  pull    keep an engine's local checkpoint up to date from a disk-delta directory
          (miles-sync pull --update-weight-disk-dir DIR --update-weight-local-checkpoint-dir DIR
          --engine-url URL [--once]; miles-sync pull --help lists its flags)
"""


def _sync_flag(name: str) -> Any:
    """SyncArgs' declaration of flag ``name`` (its help, metavar, default), for a group that
    reads it without the rest of SyncArgs; on the short ``--help``."""
    declared = SyncArgs.__dataclass_fields__[name]
    meta = dataclasses.replace(declared.metadata[FLAG_METADATA_KEY], common=True)
    return dataclasses.field(default=declared.default, metadata={FLAG_METADATA_KEY: meta})


@dataclass(frozen=True)
class PullArgs(ArgGroup):
    """The flags ``miles-sync pull`` reads, and only those."""

    title: ClassVar[str] = "disk-delta puller (miles-sync pull)"

    update_weight_disk_dir: str | None = _sync_flag("update_weight_disk_dir")
    update_weight_local_checkpoint_dir: str | None = _sync_flag(
        "update_weight_local_checkpoint_dir"
    )
    engine_url: str | None = flag(
        None,
        metavar="URL",
        common=True,
        help="The engine this puller serves (names its report file).",
    )
    pull_poll_interval: float = flag(0.5, metavar="S", help="Seconds between looks for a version.")
    once: bool = flag(
        False, common=True, help="Bring the local checkpoint up to date once and exit."
    )

    @classmethod
    def validate(cls, args: ParsedArgs) -> None:
        if not args.update_weight_disk_dir:
            raise ArgumentError("miles-sync pull requires --update-weight-disk-dir")
        if not args.engine_url:
            raise ArgumentError("miles-sync pull requires --engine-url")
        if not args.update_weight_local_checkpoint_dir:
            raise ArgumentError("miles-sync pull requires --update-weight-local-checkpoint-dir")
        if args.pull_poll_interval <= 0:
            raise ArgumentError(f"--pull-poll-interval must be > 0, got {args.pull_poll_interval}")


def parse_pull_args(argv: list[str]) -> Any:
    """The pull subcommand's flags (exits 2 on a bad command line, 0 after a help)."""
    return parse_args_or_exit(argv, [PullArgs], prog="miles-sync pull", passthrough=False)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    if not argv or argv[0] != "pull":
        if argv:
            print(f"error: unknown command {argv[0]!r} (commands: pull)", file=sys.stderr)
        else:
            print(USAGE, end="", file=sys.stderr)
        return 2
    args = parse_pull_args(argv[1:])
    # after the parse: a help or a bad flag is answered without loading the puller
    from miles_sync.errors import DeltaError

    # miles_sync.puller is off the CLI's parse path
    from miles_sync.puller import Puller, PullerConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    puller = Puller(
        PullerConfig(
            disk_dir=args.update_weight_disk_dir,
            local_dir=args.update_weight_local_checkpoint_dir,
            engine_url=args.engine_url,
            poll_interval_s=args.pull_poll_interval,
        )
    )
    try:
        puller.run(once=args.once)
    except DeltaError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
