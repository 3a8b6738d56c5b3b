"""Parsed flags for driving FSDPBackend in tests: a real command line through ``parse_args``, so
every group's validation and derived defaults run as they do for a user."""

from __future__ import annotations

from argparse import Namespace

from miles_core.args import core_groups, parse_args
from miles_fsdp.args import fsdp_groups

#: Test defaults that differ from the CLI's: fp32 compute on CPU, a visible learning rate.
TEST_DEFAULTS = dict(
    lr=1e-3, adam_beta2=0.98, attn_implementation="sdpa", fsdp_compute_dtype="fp32"
)


def command_line(**flags) -> list[str]:
    """``--flag-name value`` for each field name: ``True`` -> ``--x``, ``False`` -> ``--no-x``,
    a list -> its values, ``None`` -> nothing (the flag's unset default)."""
    argv: list[str] = []
    for key, value in flags.items():
        option = "--" + key.replace("_", "-")
        if value is None:
            continue
        if value is True:
            argv.append(option)
        elif value is False:
            argv.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            argv += [option, *map(str, value)]
        else:
            argv += [option, str(value)]
    return argv


def parse(*argv: str) -> Namespace:
    """``parse_args(argv)`` over the core and FSDP groups (argument-error tests)."""
    return parse_args(list(argv), [*core_groups(), *fsdp_groups()])


def make_args(**overrides) -> Namespace:
    """``parse_args`` of :func:`command_line` (``TEST_DEFAULTS`` updated by ``overrides``) over
    the core and FSDP groups."""
    return parse(*command_line(**(TEST_DEFAULTS | overrides)))
