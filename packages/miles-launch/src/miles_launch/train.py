"""``miles train [flags]`` / ``python -m miles_launch.train [flags]``: run one RL job.

The command line is parsed with miles-core's groups, the chosen backend's (found through its
entry point, so an FSDP run never imports megatron) and the launcher's. A bad flag prints one
``error:`` line and exits with status 2; a failure of the run (an engine that died, a trainer
rank that raised, a malformed prompt file) prints one ``error:`` block and exits with 1.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from miles_core.args import (
    ArgumentError,
    entry_point_groups,
    format_error,
    installed_groups,
    parse_args_or_exit,
    selected_backend,
)
from miles_core.backends import BackendNotInstalledError
from miles_core.checkpoint_layout import CheckpointError
from miles_core.engine import EngineError

from miles_launch.engine_launch.process import EngineDied
from miles_launch.rollout.debug_data import DebugDataError
from miles_launch.rollout.prompts import PromptDataError
from miles_launch.trainer_group import TrainerFailure

logger = logging.getLogger("miles_launch")

#: Failures reported as one ``error:`` block (exit status 1) instead of a traceback.
RUN_ERRORS = (
    EngineDied,
    EngineError,
    TrainerFailure,
    PromptDataError,
    CheckpointError,
    BackendNotInstalledError,
    DebugDataError,
)


def parse(argv: list[str]) -> Any:
    """Compose the groups for ``argv``'s backend and parse (exits 2 on a bad command line)."""
    backend = selected_backend(argv)
    try:
        groups = entry_point_groups("core", backend, "launch")
    except ArgumentError as error:
        if not {"-h", "--help"} & set(argv):
            print(format_error(error), file=sys.stderr)
            sys.exit(2)
        # --help still lists every flag of what is installed
        print(f"note: --train-backend {backend} is not installed ({error})\n")
        groups = installed_groups()
    return parse_args_or_exit(argv, groups)


def run(args: Any) -> list[dict]:
    """Set the job up, run the sync or fully-async loop, tear down; the rollout records."""
    from miles_launch.job import Job

    job = Job.setup(args)
    failed = True
    try:
        if args.load_debug_rollout_data:
            from miles_launch.replay import run_replay

            records = run_replay(job)
        elif args.fully_async:
            from miles_launch.async_loop import run_async

            records = run_async(job)
        else:
            from miles_launch.loop import run_sync

            records = run_sync(job)
        failed = False
        return records
    except EngineError:
        # a request that failed outside the watched phases: an engine's death explains it
        job.engines.explain_failure("during the run")
        raise
    finally:
        job.teardown(failed=failed)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logger.setLevel(logging.INFO)
    args = parse(argv)
    try:
        run(args)
    except RUN_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
