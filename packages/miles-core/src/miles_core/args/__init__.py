"""The argument framework: dataclass groups composed into one CLI (DESIGN.md, one owner per flag).

Declare a group next to the code that uses it::

    @dataclass
    class FSDPArgs(ArgGroup):
        title: ClassVar[str] = "FSDP backend"
        dp_replicate_size: int = flag(1, help="Replicas of the sharded model (HSDP).")

        @classmethod
        def validate(cls, args): ...

and parse with ``parse_args(argv, [*core_groups(), FSDPArgs, ...])``; the namespace it returns
carries the typed ``args.run_config`` (:class:`RunConfig`). See docs/args.md.
"""

from miles_core.args.flags import (
    ArgGroup,
    ArgumentError,
    FlagSpec,
    flag,
    group_flags,
    make_group,
)
from miles_core.args.groups import core_groups
from miles_core.args.groups.placement import selected_backend
from miles_core.args.help import group_help_name, help_request
from miles_core.args.parsed import ParsedArgs
from miles_core.args.parser import (
    build_parser,
    collect_flags,
    format_error,
    parse_args,
    parse_args_or_exit,
)
from miles_core.args.passthrough import passthrough_to_argv
from miles_core.args.registry import entry_point_groups, installed_groups
from miles_core.args.run_config import RunConfig

__all__ = [
    "ArgGroup",
    "ArgumentError",
    "FlagSpec",
    "ParsedArgs",
    "RunConfig",
    "build_parser",
    "collect_flags",
    "core_groups",
    "entry_point_groups",
    "flag",
    "format_error",
    "group_flags",
    "group_help_name",
    "help_request",
    "installed_groups",
    "make_group",
    "parse_args",
    "parse_args_or_exit",
    "passthrough_to_argv",
    "selected_backend",
]
