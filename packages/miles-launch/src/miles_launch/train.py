"""``miles train [flags]`` / ``python -m miles_launch.train [flags]``: run one RL job.

The command line is parsed with miles-core's groups, the chosen backend's (found through its
entry point, so an FSDP run never imports megatron) and the launcher's, then the job is checked
as a whole before anything starts (:mod:`miles_launch.preflight`: the model directory, every
output path, every prompt record, the checkpoints to load, this machine). A bad flag or a
failed check prints one ``error:`` line each and exits with status 2; then the plan
(:mod:`miles_launch.plan`) is printed, and ``--dry-run`` stops there (exit 0). A failure of
the run (an engine that died, a trainer rank that raised) prints one ``error:`` block and
exits with 1.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
import time
from typing import Any

from miles_core.args import (
    ArgumentError,
    entry_point_groups,
    format_error,
    group_help_name,
    help_request,
    installed_groups,
    parse_args,
    selected_backend,
)
from miles_core.args.checks import option
from miles_core.args.parsed import ParsedArgs
from miles_core.backends import BackendNotInstalledError, available

logger = logging.getLogger("miles_launch")


def run_errors() -> tuple[type[BaseException], ...]:
    """Failures reported as one ``error:`` block (exit status 1) instead of a traceback
    (imported when the job runs: the preflight's errors come before any of this loads)."""
    # miles_core.checkpoint_layout is off the CLI's parse path
    from miles_core.checkpoint_layout import CheckpointError
    from miles_core.engine import EngineError  # miles_core.engine is off the CLI's parse path

    # miles_launch.engine_launch.process is off the CLI's parse path
    from miles_launch.engine_launch.process import EngineDied

    # miles_launch.rollout.debug_data is off the CLI's parse path
    from miles_launch.rollout.debug_data import DebugDataError

    # miles_launch.rollout.prompts is off the CLI's parse path
    from miles_launch.rollout.prompts import PromptDataError

    # miles_launch.trainer_group is off the CLI's parse path
    from miles_launch.trainer_group import TrainerFailure

    return (
        EngineDied,
        EngineError,
        TrainerFailure,
        PromptDataError,
        CheckpointError,
        BackendNotInstalledError,
        DebugDataError,
    )


PROG = "miles train"


def compose(argv: list[str]) -> list:
    """The flag groups of ``argv``'s backend (exits 2 when it is not installed)."""
    backend = selected_backend(argv)
    try:
        groups = entry_point_groups("core", backend, "launch")
    except ArgumentError as error:
        if help_request(argv) is None:
            print(format_error(error), file=sys.stderr)
            sys.exit(2)
        # the help still lists the flags of what is installed
        print(f"note: --train-backend {backend} is not installed ({error})\n")
        return installed_groups()
    refuse_other_backends_group(argv, groups)
    return groups


def refuse_other_backends_group(argv: list[str], groups: list) -> None:
    """``--help GROUP`` of a group another backend adds: one line naming that backend, exit 2."""
    request = help_request(argv)
    if request is None or request.form != "group":
        return
    if request.group in {group_help_name(group) for group in groups}:
        return

    for name in sorted(available()):
        try:
            theirs = {group_help_name(group) for group in entry_point_groups(name)}
        except ArgumentError:
            continue
        if request.group in theirs:
            print(
                f"error: --help {request.group}: a group of --train-backend {name} "
                f"(`{PROG} --train-backend {name} --help {request.group}`)",
                file=sys.stderr,
            )
            sys.exit(2)


def backend_note(argv: list[str]) -> str | None:
    """The help's closing note: whose flags are listed, and which groups each installed backend
    adds (``None`` unless ``argv`` asks for help: a job need not import the other backend's)."""
    if help_request(argv) is None:
        return None

    backend = selected_backend(argv)
    installed = sorted(available())
    others = [name for name in installed if name != backend]
    note = f"Listed: the flags of --train-backend {backend}."
    if others:
        note += f" `{PROG} --train-backend {others[0]} --help` lists {others[0]}'s"
        note += f" (installed: {', '.join(sorted({backend, *installed}))})."
    adds = []
    for name in installed:
        try:
            names = [group_help_name(group) for group in entry_point_groups(name)]
        except ArgumentError:  # a backend without argument groups adds none
            continue
        adds.append(f"--train-backend {name} adds {', '.join(names)}")
    if adds:
        note += " Backend groups: " + "; ".join(adds) + "."
    return note


def parse(argv: list[str]) -> Any:
    """Compose the groups for ``argv``'s backend and parse (exits 2 on a bad command line)."""
    return parse_or_exit(argv, compose(argv))


def parse_or_exit(argv: list[str], groups: list) -> Any:
    """Parse ``argv`` with ``groups``; a bad command line prints one ``error:`` line and exits
    with 2. A flag that only another installed backend declares is named with that backend."""
    try:
        return parse_args(argv, groups, prog=PROG, epilog=backend_note(argv))
    except ArgumentError as error:
        print(format_error(other_backends_flag(error, argv) or error), file=sys.stderr)
        sys.exit(2)


def _fields(group: Any) -> tuple[dataclasses.Field, ...]:
    """A flag group's fields (none for a group that is not a dataclass)."""
    return dataclasses.fields(group) if dataclasses.is_dataclass(group) else ()


UNKNOWN_FLAG = re.compile(r"^unrecognized flag (--[\w-]+)")


def other_backends_flag(error: ArgumentError, argv: list[str]) -> ArgumentError | None:
    """``--gradient-checkpointing is a flag of --train-backend fsdp, not of megatron`` when
    ``error`` is an unknown flag that another installed backend's groups declare (their
    argument groups only: no backend code is imported); None otherwise."""
    match = UNKNOWN_FLAG.match(str(error))
    if match is None:
        return None

    flag, backend = match.group(1), selected_backend(argv)
    for name in sorted(set(available()) - {backend}):
        try:
            groups = entry_point_groups(name)
        except ArgumentError:  # a backend without argument groups declares no flag
            continue
        declared = {option(f.name) for g in groups for f in _fields(g)}
        if flag in declared or flag.replace("--no-", "--", 1) in declared:
            return ArgumentError(
                f"{flag} is a flag of --train-backend {name}, not of --train-backend {backend}"
                " (this job's backend)"
            )
    return None


def check_job(argv: list[str]) -> tuple[Any, list[str]]:
    """Parse and run the preflight (:mod:`miles_launch.preflight`); every problem is one
    ``error:`` line, then exit status 2. Returns the flags and the plan lines."""
    groups = compose(argv)
    args = parse_or_exit(argv, groups)
    # after the parse: an argument error is reported before torch (which these import) loads
    from miles_launch.plan import plan_lines

    # miles_launch.preflight is off the CLI's parse path
    from miles_launch.preflight import local_gpus, preflight

    result = preflight(args, groups)
    if result.problems:
        for problem in result.problems:
            print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    return args, plan_lines(args, local_gpus() > 0 and not args.ray_address, result.notes)


def run(args: ParsedArgs) -> list[dict]:
    """Set the job up, run the sync or fully-async loop, tear down; the rollout records."""
    from miles_core.engine import EngineError  # miles_core.engine is off the CLI's parse path

    from miles_launch.job import Job  # miles_launch.job is off the CLI's parse path

    started = time.monotonic()
    job = Job.setup(args)
    failed = True
    try:
        if args.load_debug_rollout_data:
            # miles_launch.replay is off the CLI's parse path
            from miles_launch.replay import run_replay

            records = run_replay(job)
        elif args.fully_async:
            # miles_launch.async_loop is off the CLI's parse path
            from miles_launch.async_loop import run_async

            records = run_async(job)
        else:
            from miles_launch.loop import run_sync  # miles_launch.loop is off the CLI's parse path

            records = run_sync(job)
        failed = False
    except EngineError:
        # a request that failed outside the watched phases: an engine's death explains it
        job.engines.explain_failure("during the run")
        raise
    finally:
        job.teardown(failed=failed)
    # miles_launch.reporting is off the CLI's parse path
    from miles_launch.reporting import closing_lines

    for line in closing_lines(args, records, time.monotonic() - started):
        print(line, flush=True)
    return records


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logger.setLevel(logging.INFO)
    started = time.monotonic()
    args, plan = check_job(argv)
    # miles_launch.preflight is off the CLI's parse path
    from miles_launch.preflight import make_outputs

    # miles_launch.reporting is off the CLI's parse path
    from miles_launch.reporting import phase, start_clock

    start_clock(started)
    for line in plan:
        print(line, flush=True)
    if args.dry_run:
        return
    make_outputs(args)
    phase("preflight passed")
    try:
        run(args)
    except run_errors() as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
