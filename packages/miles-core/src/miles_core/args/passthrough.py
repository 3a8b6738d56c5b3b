"""``--sglang-<flag>`` / ``--router-<flag>`` passthrough: flags no group declares, handed on verbatim.

Any flag of ``python -m sglang.launch_server`` is accepted as ``--sglang-<flag>``, and any flag of
the router as ``--router-<flag>``. A declared flag with such a name (``--sglang-router-ip``) is
parsed as a normal flag and never passed through. Values are the tokens that follow up to the next
``--`` token: none -> ``True``, one -> that string, several -> a list of strings;
``--sglang-x=v`` gives ``"v"``. A repeated flag keeps its last value.
"""

from __future__ import annotations

from typing import Literal

PASSTHROUGH_PREFIXES = {"--sglang-": "sglang_passthrough", "--router-": "router_passthrough"}

#: ``True`` for a flag without a value (a YAML ``false`` drops the flag: config_file)
PassthroughValue = str | list[str] | Literal[True]


def _prefix_of(token: str) -> str | None:
    for prefix in PASSTHROUGH_PREFIXES:
        if token.startswith(prefix) and len(token) > len(prefix):
            return prefix
    return None


def split_passthrough(
    argv: list[str], declared: set[str]
) -> tuple[list[str], dict[str, dict[str, PassthroughValue]]]:
    """Remove undeclared ``--sglang-*`` / ``--router-*`` flags and their values from ``argv``.

    Returns the remaining argv and ``{"sglang_passthrough": {...}, "router_passthrough": {...}}``
    keyed by the flag name without prefix (``"mem-fraction-static"``).
    """
    remaining: list[str] = []
    found: dict[str, dict[str, PassthroughValue]] = {d: {} for d in PASSTHROUGH_PREFIXES.values()}
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, inline = token.partition("=")
        prefix = _prefix_of(name)
        if prefix is None or name in declared:
            remaining.append(token)
            i += 1
            continue
        key = name[len(prefix) :]
        i += 1
        if eq:
            value: PassthroughValue = inline
        else:
            values = []
            while i < len(argv) and not argv[i].startswith("--"):
                values.append(argv[i])
                i += 1
            value = True if not values else values[0] if len(values) == 1 else values
        found[PASSTHROUGH_PREFIXES[prefix]][key] = value
    return remaining, found


def passthrough_to_argv(values: dict[str, PassthroughValue]) -> list[str]:
    """The flags to hand to the engine (or router): ``{"dp-size": "8"}`` -> ``["--dp-size", "8"]``."""
    out: list[str] = []
    for key, value in values.items():
        out.append(f"--{key}")
        if value is True:
            continue
        out.extend(value if isinstance(value, list) else [value])
    return out
