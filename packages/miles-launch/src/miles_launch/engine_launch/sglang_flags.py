"""``--sglang-<x>`` passthrough flags checked with SGLang's own server argument parser.

During argument validation, before Ray or any engine starts: when ``sglang`` is importable on
this machine, the passthrough flags (as ``sglang.launch_server`` will receive them) are parsed by
the parser of ``sglang.srt.server_args.ServerArgs``. A flag SGLang does not have (say
``--sglang-enable-ep-moe``, gone in 0.5.23), an ambiguous abbreviation or a value it refuses is
an :class:`~miles_core.args.ArgumentError` (exit status 2, one line) naming the flag and the
SGLang version. When sglang is not importable here (it runs on other machines, or in another
environment), a note says once that the flags are passed through unchecked.

Importing ``sglang.srt.server_args`` takes a few seconds (its package imports the frontend).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import logging
import re
from typing import Any

from miles_core.args import ArgumentError, passthrough_to_argv

logger = logging.getLogger(__name__)

_noted_unchecked = False


class _Refused(Exception):
    pass


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message):
        raise _Refused(message)


def _importable() -> bool:
    try:
        return importlib.util.find_spec("sglang") is not None
    except ValueError:  # a module named sglang without a spec
        return False


def _sglang_version() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "(unknown version)"


def _note_unchecked(reason: str) -> None:
    global _noted_unchecked
    if not _noted_unchecked:
        _noted_unchecked = True
        logger.warning("--sglang-* flags are passed to SGLang unchecked: %s", reason)


def _ours(message: str, passthrough: dict[str, Any]) -> str:
    """The first ``--x`` of SGLang's message that is one of ours, as ``--sglang-x``."""
    for token in re.findall(r"--[A-Za-z0-9][A-Za-z0-9_-]*", message):
        if token[2:] in passthrough:
            return f"--sglang-{token[2:]}"
    return "--sglang-* flags"


def check_with_sglang(passthrough: dict[str, Any]) -> None:
    """Parse ``passthrough`` (``args.sglang_passthrough``) with SGLang's server parser when
    sglang is importable; raise :class:`ArgumentError` naming the first flag it refuses."""
    if not passthrough:
        return
    if not _importable():
        _note_unchecked("sglang is not importable here")
        return
    try:
        from sglang.srt.server_args import ServerArgs  # optional dependency (the SGLang engine)
    except Exception as error:  # importable but broken here (e.g. missing native libraries)
        _note_unchecked(f"importing sglang.srt.server_args failed: {error}")
        return
    version = _sglang_version()
    parser = _RaisingParser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    argv = ["--model-path", "model", *passthrough_to_argv(passthrough)]
    try:
        _, unknown = parser.parse_known_args(argv)
    except _Refused as refused:
        raise ArgumentError(
            f"{_ours(str(refused), passthrough)}: refused by SGLang {version}'s server argument "
            f"parser: {refused}"
        ) from None
    flags = [token.split("=", 1)[0] for token in unknown if token.startswith("--")]
    if flags:
        raise ArgumentError(
            f"--sglang-{flags[0][2:]}: SGLang {version} has no server flag {flags[0]} "
            "(python -m sglang.launch_server --help lists them)"
        )
    if unknown:
        raise ArgumentError(
            f"--sglang-* flags: SGLang {version}'s server argument parser left {unknown} "
            "unparsed (a value given to a flag that takes none?)"
        )
