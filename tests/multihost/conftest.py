"""One set of network-namespace hosts, and one Ray cluster on them, for every multi-host test
(session scope).

Host a (10.123.0.1) is the Ray head with 2 CPU slots (the trainer's); hosts b and c have 1
slot each (one engine each). Where namespaces cannot be made (no root, no iproute2), every
multi-host test skips with one line saying why. Every process of the hosts runs with the
megatron CPU shim's ``PYTHONPATH`` (tests/miles_megatron/megatron_cli.py): Ray's workers inherit
their node's environment, and the shim installs itself only in processes that import
``miles_megatron``, so the FSDP jobs run as they would without it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from netns_cluster import CannotMakeNamespaces, NamespaceCluster, probe

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "miles_megatron"))
from megatron_cli import megatron_cli_env  # noqa: E402


@pytest.fixture(scope="session")
def hosts():
    """The three hosts and their links; removed at the end of the session."""
    try:
        probe()
    except CannotMakeNamespaces as why:
        pytest.skip(f"multi-host tests need network namespaces: {why}")
    shim = {"PYTHONPATH": megatron_cli_env()["PYTHONPATH"]}
    made = NamespaceCluster([2, 1, 1], env_extra=shim).make_network()
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(scope="session")
def cluster(hosts):
    """The same hosts with the Ray cluster started on them (once per session)."""
    if hosts.head.ray is None:
        hosts.start_ray()
    return hosts


@pytest.fixture(scope="session")
def material(tmp_path_factory):
    from miles_launch.demo import build_tiny_qwen3, write_demo_prompts

    root = tmp_path_factory.mktemp("multihost")
    return build_tiny_qwen3(root / "tiny-qwen3"), write_demo_prompts(root / "prompts.jsonl")
