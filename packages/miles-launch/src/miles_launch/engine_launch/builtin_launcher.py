"""The command line of one built-in engine (``python -m miles_launch.builtin_engine``).

The built-in engine serves the HF model with transformers on one device; ``--sglang-*``
passthrough flags do not apply to it (they are logged and ignored). Under
``--use-rollout-routing-replay`` it runs with ``--enable-return-routed-experts``, under
``--true-on-policy`` with ``--true-on-policy`` (:mod:`miles_core.batch_invariant`). The API key travels in the environment
(:func:`builtin_engine_env`), not on the command line.
"""

from __future__ import annotations

import logging
import sys

from miles_core.args.parsed import ParsedArgs

from miles_launch.engine_launch.api_key import API_KEY_ENV
from miles_launch.rollout.routed_experts import routing_replay_on

logger = logging.getLogger(__name__)


def builtin_engine_env(args: ParsedArgs) -> dict[str, str]:
    """Environment of one built-in engine: the job's API key, when there is one."""
    key = args.sglang_api_key
    return {API_KEY_ENV: key} if key else {}


def builtin_engine_command(
    args: ParsedArgs, *, host: str, port: int, device: str, python: str = sys.executable
) -> list[str]:
    """``python -m miles_launch.builtin_engine ...`` for one engine of this job."""
    if args.sglang_passthrough:
        logger.warning(
            "built-in engine: ignoring SGLang flags %s",
            " ".join(f"--sglang-{k}" for k in args.sglang_passthrough),
        )
    cmd = [
        python,
        "-m",
        "miles_launch.builtin_engine",
        "--model-path",
        str(args.hf_checkpoint),
        "--host",
        host,
        "--port",
        str(port),
        "--device",
        device,
    ]
    if args.sglang_context_length is not None:
        cmd += ["--context-length", str(args.sglang_context_length)]
    if args.offload_rollout:
        cmd.append("--enable-memory-saver")
    if routing_replay_on(args):
        cmd.append("--enable-return-routed-experts")
    if args.true_on_policy:
        cmd.append("--true-on-policy")
    return cmd
