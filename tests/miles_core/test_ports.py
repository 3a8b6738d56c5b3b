"""miles_core.ports.free_port: the port a server binds later is one the kernel never hands out
to a socket that binds port 0 or connects (the race CI lost: an engine's picked port taken by
another test's socket before the engine bound it)."""

from __future__ import annotations

import contextlib
import random
import socket

import pytest
from miles_core import ports
from miles_core.ports import candidate_ports, ephemeral_range, free_port, is_free


def test_ports_lie_outside_the_kernels_ephemeral_range():
    low, high = ephemeral_range()
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        assert (low, high) == tuple(int(v) for v in f.read().split())
    picked = {free_port() for _ in range(50)}
    assert all(p >= ports.LOWEST_PORT and not low <= p <= high for p in picked)
    assert len(picked) > 40  # random, not one fixed port every caller would share


def test_sockets_the_kernel_numbers_never_take_the_picked_port():
    """Bind 2,000 sockets to port 0 (what gloo's pair sockets and clients get): none of them
    gets the port just picked, which the old bind-0-and-close recipe could not promise."""
    port = free_port("127.0.0.1")
    low, high = ephemeral_range()
    with contextlib.ExitStack() as stack:
        given = []
        for _ in range(2000):
            s = stack.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            given.append(s.getsockname()[1])
        assert all(low <= p <= high for p in given)  # the kernel's numbers: the range we avoid
        assert port not in given
        server = stack.enter_context(socket.socket())
        server.bind(("127.0.0.1", port))  # the server still binds it
        server.listen()


def test_a_port_in_use_is_skipped():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        busy = taken.getsockname()[1]
        assert not is_free(busy)  # every address checked: one bound on loopback counts

        candidates = [p for r in candidate_ports(ephemeral_range()) for p in r]
        assert busy in candidates
        other = free_port()
        sampled = []

        class Scripted(random.Random):
            def sample(self, population, k, **kwargs):  # type: ignore[override]
                sampled.append((len(population), k))
                return [busy, other]

        port = free_port(rng=Scripted())
        assert sampled == [(len(candidates), ports.ATTEMPTS)]
        assert port == other  # the busy draw was refused, the next one taken


@pytest.mark.parametrize(
    ("ephemeral", "expected"),
    [
        ((32768, 60999), [range(20000, 32768), range(61000, 65536)]),
        ((1024, 65535), []),  # nothing left outside: the kernel picks
        ((49152, 65535), [range(20000, 49152)]),
    ],
)
def test_candidates_avoid_the_range(ephemeral, expected):
    assert candidate_ports(ephemeral) == expected


def test_a_range_that_leaves_no_room_falls_back_to_a_kernel_port(monkeypatch, tmp_path):
    whole = tmp_path / "range"
    whole.write_text("1024\t65535\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", whole)
    assert ephemeral_range() == (1024, 65535)

    class NoDraws(random.Random):
        def sample(self, population, k, **kwargs):  # type: ignore[override]
            assert not population and k == 0, "no candidate range, so nothing to draw from"
            return []

    port = free_port("127.0.0.1", rng=NoDraws())
    assert 1024 <= port <= 65535 and is_free(port, "127.0.0.1")
    (tmp_path / "unreadable").mkdir()
    assert ephemeral_range(tmp_path / "unreadable") == ports.DEFAULT_EPHEMERAL_RANGE
