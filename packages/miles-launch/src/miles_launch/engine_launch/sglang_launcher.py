"""The command line of one SGLang server (``python -m sglang.launch_server``).

Miles sets ``--model-path`` (from ``--hf-checkpoint``), ``--tp-size`` (from
``--rollout-num-gpus-per-engine``), ``--host`` and ``--port``; ``--sglang-mem-fraction-static``
and ``--sglang-context-length`` are declared flags turned into ``--mem-fraction-static`` and
``--context-length``, ``--sglang-api-key`` is SGLang's ``--api-key``, written to a private file
that ``--config`` names (SGLang reads its options from that YAML; the key stays out of ``ps``);
every undeclared ``--sglang-<x>`` is passed through as ``--<x>`` (not ``--sglang-config``).
``--enable-memory-saver`` is added under ``--offload-rollout``,
``--enable-return-routed-experts`` under ``--use-rollout-routing-replay``, and SGLang's own
true on-policy switches (:data:`TRUE_ON_POLICY_SWITCHES`) under ``--true-on-policy``; a switch
the job's ``--sglang-<x>`` flags already name is left to them.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from miles_core.args import ArgumentError, passthrough_to_argv
from miles_core.args.parsed import ParsedArgs

from miles_launch.engine_launch.process import SECRET_FILE
from miles_launch.rollout.routed_experts import routing_replay_on

#: Flags of ``sglang.launch_server`` that miles sets itself: a ``--sglang-<x>`` for one of them
#: is an error naming the miles flag to use instead.
RESERVED = {
    "model-path": "--hf-checkpoint",
    "tp-size": "--rollout-num-gpus-per-engine",
    "tensor-parallel-size": "--rollout-num-gpus-per-engine",
    "host": "(set by miles)",
    "port": "(set by miles)",
    # miles writes SGLang's --config file: it carries the API key (give options as --sglang-<x>)
    "config": "(set by miles)",
}


#: SGLang's switches for ``--true-on-policy`` (its own mode of matching an FSDP trainer): the
#: target, deterministic inference (batch-invariant ops), and an attention backend of its
#: deterministic ones. Bitwise agreement with this trainer is not verified (docs/rl-math.md).
TRUE_ON_POLICY_SWITCHES: tuple[tuple[str, str | None], ...] = (
    ("rl-on-policy-target", "fsdp"),
    ("enable-deterministic-inference", None),
    ("attention-backend", "fa3"),
)


def check_passthrough(passthrough: dict[str, Any]) -> None:
    """Refuse ``--sglang-<x>`` for a flag miles sets itself (one line naming both)."""
    for key in passthrough:
        if key in RESERVED:
            raise ArgumentError(
                f"--sglang-{key} is set by miles: use {RESERVED[key]}"
                if RESERVED[key].startswith("--")
                else f"--sglang-{key} is set by miles per engine"
            )


def sglang_secret_config(args: ParsedArgs) -> str | None:
    """The YAML of SGLang's ``--config`` file holding the job's API key (None without one):
    the engine host writes it to a file only the job's user can read."""
    key = args.sglang_api_key
    return None if not key else f"api-key: {json.dumps(key)}\n"


def sglang_server_command(
    args: ParsedArgs, *, host: str, port: int, python: str = sys.executable
) -> list[str]:
    """``python -m sglang.launch_server ...`` for one engine of this job."""
    check_passthrough(args.sglang_passthrough)
    cmd = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(args.hf_checkpoint),
        "--tp-size",
        str(args.rollout_num_gpus_per_engine),
        "--host",
        host,
        "--port",
        str(port),
    ]
    if args.sglang_mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(args.sglang_mem_fraction_static)]
    if args.sglang_context_length is not None:
        cmd += ["--context-length", str(args.sglang_context_length)]
    if args.sglang_api_key:
        # the key is read from a private file (SGLang's --config YAML), not from argv
        cmd += ["--config", SECRET_FILE]
    if args.offload_rollout and "enable-memory-saver" not in args.sglang_passthrough:
        cmd.append("--enable-memory-saver")
    if routing_replay_on(args) and "enable-return-routed-experts" not in args.sglang_passthrough:
        cmd.append("--enable-return-routed-experts")
    if args.true_on_policy:
        for name, value in TRUE_ON_POLICY_SWITCHES:
            if name not in args.sglang_passthrough:
                cmd += [f"--{name}"] if value is None else [f"--{name}", value]
    cmd += passthrough_to_argv(args.sglang_passthrough)
    return cmd
