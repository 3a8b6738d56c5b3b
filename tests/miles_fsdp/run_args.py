"""Parsed-flag namespaces for driving FSDPBackend in tests: the real CLI's defaults."""

from __future__ import annotations

from argparse import Namespace

from miles_core.args import core_groups, parse_args
from miles_fsdp.args import fsdp_groups

#: Test defaults that differ from the CLI's: fp32 compute on CPU, a visible learning rate.
TEST_DEFAULTS = dict(
    lr=1e-3, adam_beta2=0.98, attn_implementation="sdpa", fsdp_compute_dtype="fp32"
)


def make_args(**overrides) -> Namespace:
    """``parse_args([])`` over the core and FSDP groups, then ``overrides`` set by field name."""
    args = parse_args([], [*core_groups(), *fsdp_groups()])
    for key, value in (TEST_DEFAULTS | overrides).items():
        assert hasattr(args, key), f"no flag for {key}"
        setattr(args, key, value)
    return args
