"""SyncConfig from parsed flags, and the combinations it refuses."""

from __future__ import annotations

import pytest
from miles_core.args import ArgumentError, core_groups, parse_args
from miles_sync.weight_sync import SyncConfig


def parse(*argv):
    return parse_args(list(argv), core_groups())


def test_from_args_defaults_by_placement():
    assert SyncConfig.from_args(parse()).mode == "broadcast"
    assert not SyncConfig.from_args(parse()).verify
    assert SyncConfig.from_args(parse("--update-weight-verify")).verify
    colocated = SyncConfig.from_args(parse("--colocate"))
    assert colocated.mode == "ipc" and colocated.colocate
    cfg = SyncConfig.from_args(
        parse(
            "--update-weight-transfer-mode",
            "disk-delta",
            "--update-weight-disk-dir",
            "/shared",
            "--update-weight-delta-checksum",
            "blake3",
            "--update-weight-buffer-size",
            "1024",
            "--pause-generation-mode",
            "abort",
        )
    )
    assert (cfg.mode, cfg.disk_dir, cfg.delta_checksum, cfg.buffer_size, cfg.pause_mode) == (
        "disk-delta",
        "/shared",
        "blake3",
        1024,
        "abort",
    )


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"mode": "p2p", "colocate": True}, "p2p is not for --colocate"),
        ({"mode": "disk-delta", "colocate": True, "disk_dir": "/x"}, "not for --colocate"),
        ({"mode": "disk-delta"}, "requires --update-weight-disk-dir"),
        ({"mode": "rdma"}, "must be one of"),
        ({"buffer_size": 0}, "--update-weight-buffer-size"),
    ],
)
def test_refused_combinations(kwargs, message):
    with pytest.raises(ArgumentError, match=message):
        SyncConfig(**kwargs)


def test_group_master_address_is_the_publishing_rank_s_node_address(monkeypatch):
    """No loopback default: unset, the weight-update group advertises the address this node is
    reached on (the launcher's MILES_NODE_IP, else the route towards the engine)."""
    import socket

    from miles_sync.node_address import NODE_IP_ENV, node_address

    assert SyncConfig.from_args(parse()).master_address is None
    monkeypatch.delenv(NODE_IP_ENV, raising=False)
    assert node_address("http://127.0.0.1:30000") == "127.0.0.1"

    # Towards a non-loopback address of this host, the route's source is that address.
    def local(address: str) -> bool:
        with socket.socket() as s:
            try:
                s.bind((address, 0))
            except OSError:
                return False
        return not address.startswith("127.")

    infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    for address in {info[4][0] for info in infos if local(info[4][0])}:
        assert node_address(f"http://{address}:30000") == address
    monkeypatch.setenv(NODE_IP_ENV, "10.9.8.7")
    assert node_address("http://127.0.0.1:30000") == "10.9.8.7"
