"""SyncConfig from parsed flags, and the combinations it refuses."""

from __future__ import annotations

import pytest
from miles_core.args import ArgumentError, core_groups, parse_args
from miles_sync.weight_sync import SyncConfig


def parse(*argv):
    return parse_args(list(argv), core_groups())


def test_from_args_defaults_by_placement():
    assert SyncConfig.from_args(parse()).mode == "broadcast"
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
