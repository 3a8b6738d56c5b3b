"""A free TCP port for a server that another process binds later (an engine, a rendezvous store).

The usual recipe, bind port 0 and close the socket, returns a port from the kernel's ephemeral
range, and the kernel hands that port out again to the next socket that binds port 0 or connects
(gloo's pair sockets, NCCL's bootstrap, an HTTP client), possibly before the server binds it: the
server then fails with "address already in use". A port outside the ephemeral range is never
handed out implicitly, so between the pick and the bind only another explicit pick can take it.

:func:`free_port` picks at random among such ports and checks that nothing listens on it. Where
a server can be handed a listening socket (or binds port 0 itself and reports the port), that is
still better: nothing can take the port in between.
"""

from __future__ import annotations

import errno
import random
import socket
from pathlib import Path

#: Where Linux keeps the ephemeral range ("low high").
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")

#: Linux's default ephemeral range, used where the file cannot be read.
DEFAULT_EPHEMERAL_RANGE = (32768, 60999)

#: The lowest port picked. Ray's worker processes listen on 10002-19999 by default, and well-known
#: services sit lower still.
LOWEST_PORT = 20000

#: Random candidates (distinct) tried before falling back to a kernel-chosen (ephemeral) port.
ATTEMPTS = 64


def ephemeral_range(path: Path | None = None) -> tuple[int, int]:
    """The kernel's ephemeral port range (inclusive), from ``path`` (default
    :data:`EPHEMERAL_RANGE_FILE`; Linux's default range where it cannot be read)."""
    try:
        low, high = (int(v) for v in (path or EPHEMERAL_RANGE_FILE).read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_RANGE
    return low, high


def candidate_ports(ephemeral: tuple[int, int]) -> list[range]:
    """The port ranges outside ``ephemeral`` and at or above :data:`LOWEST_PORT` (maybe none)."""
    low, high = ephemeral
    ranges = [range(LOWEST_PORT, min(low, 65536)), range(max(high + 1, LOWEST_PORT), 65536)]
    return [r for r in ranges if len(r) > 0]


def is_free(port: int, host: str = "") -> bool:
    """Whether ``port`` can be bound on ``host`` now ("" is every address, the strictest check:
    it also fails where a socket listens on one address only)."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
                return False
            raise
    return True


def free_port(host: str = "", rng: random.Random | None = None) -> int:
    """A port that nothing listens on, outside the kernel's ephemeral range where the range
    leaves any room (else one the kernel picks)."""
    candidates = [port for r in candidate_ports(ephemeral_range()) for port in r]
    drawn = (rng or random.SystemRandom()).sample(candidates, min(ATTEMPTS, len(candidates)))
    for port in drawn:
        if is_free(port, host):
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
