"""One Ray cluster of network-namespace hosts for every multi-host test (session scope).

Host a (10.123.0.1) is the Ray head with 2 CPU slots (the trainer's); hosts b and c have 1
slot each (one engine each). Where namespaces cannot be made (no root, no iproute2), every
multi-host test skips with one line saying why.
"""

from __future__ import annotations

import pytest
from netns_cluster import CannotMakeNamespaces, NamespaceCluster, probe


@pytest.fixture(scope="session")
def cluster():
    try:
        probe()
    except CannotMakeNamespaces as why:
        pytest.skip(f"multi-host tests need network namespaces: {why}")
    made = NamespaceCluster([2, 1, 1])
    made.start()
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(scope="session")
def material(tmp_path_factory):
    from miles_launch.demo import build_tiny_qwen3, write_demo_prompts

    root = tmp_path_factory.mktemp("multihost")
    return build_tiny_qwen3(root / "tiny-qwen3"), write_demo_prompts(root / "prompts.jsonl")
