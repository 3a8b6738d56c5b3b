"""The type of the parsed command line, as every package entry point that takes it names it."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # run_config imports the groups, which take ParsedArgs: a cycle at run time
    from miles_core.args.run_config import RunConfig


class ParsedArgs(argparse.Namespace):
    """The namespace :func:`~miles_core.args.parse_args` returns: one attribute per declared flag
    (read as ``argparse`` gives them, untyped) and the typed
    :class:`~miles_core.args.run_config.RunConfig` of its groups, ``run_config``, through which a
    reader gets declared types (set once every hook has run)."""

    run_config: RunConfig
    explicit_flags: frozenset[str]
