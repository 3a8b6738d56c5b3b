"""The one API key of the engine control plane (``--sglang-api-key``).

The key is passed to every engine the launcher starts (SGLang as ``--api-key``, the built-in
engine through :data:`API_KEY_ENV`, so that it is not in the process list) and to the router it
starts (``--api-key``, which the router uses towards its workers); every client of ours sends it
as ``Authorization: Bearer``: the rollout's generation clients, the engine set's own calls,
router registration and the trainer's weight publisher (``SyncConfig.engine_api_key``).

When the engines bind a non-loopback address and no key was given, :func:`ensure_api_key`
generates one for the job. The key is never printed in full (:func:`redact`); command lines
are logged with it masked (:func:`redact_argv`).
"""

from __future__ import annotations

import ipaddress
import logging
import secrets

from miles_core.args.parsed import ParsedArgs

logger = logging.getLogger(__name__)

#: Environment variable the built-in engine reads its key from (``--api-key`` also works).
API_KEY_ENV = "MILES_ENGINE_API_KEY"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable from this host only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def redact(key: str | None) -> str:
    """A key as logs may show it: its first 4 characters and its length."""
    if not key:
        return "(none)"
    return f"{key[:4]}... ({len(key)} chars)"


def redact_argv(cmd: list[str]) -> list[str]:
    """``cmd`` with the value of every ``--api-key`` masked."""
    out = list(cmd)
    for i, token in enumerate(out):
        if token == "--api-key" and i + 1 < len(out):
            out[i + 1] = redact(out[i + 1])
        elif token.startswith("--api-key="):
            out[i] = "--api-key=" + redact(token.partition("=")[2])
    return out


def ensure_api_key(args: ParsedArgs, bind_host: str) -> str | None:
    """The job's key: ``--sglang-api-key``, or, when engines bind ``bind_host`` (not loopback)
    without one, a new random key stored in ``args.sglang_api_key`` for everything started
    after this call. Returns the key (None: loopback without a key)."""
    key = args.sglang_api_key
    if key or is_loopback(bind_host):
        return key or None
    args.sglang_api_key = secrets.token_urlsafe(32)
    logger.info(
        "engines bind %s without --sglang-api-key: generated a key for this job (%s)",
        bind_host,
        redact(args.sglang_api_key),
    )
    return args.sglang_api_key
