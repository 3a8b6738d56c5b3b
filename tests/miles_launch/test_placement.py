"""Bundle layout arithmetic: disaggregated and colocated jobs, and their nodes."""

from __future__ import annotations

import pytest
from launch_testing import parse
from miles_core.args import ArgumentError
from miles_launch.placement import LayoutDoesNotFit, assign_nodes, nodes_needed, plan_layout


def test_disaggregated_layout_puts_engines_after_the_trainer(tmp_path):
    args = parse(
        tmp_path,
        "--rollout-engine", "sglang",
        "--actor-num-nodes", "2",
        "--actor-num-gpus-per-node", "8",
        "--rollout-num-gpus", "8",
        "--rollout-num-gpus-per-engine", "2",
    )  # fmt: skip
    layout = plan_layout(args, use_gpu=True)
    assert layout.num_trainer_ranks == 16
    assert layout.num_bundles == 24
    assert layout.trainer_bundles() == list(range(16))
    assert layout.engine_bundles() == [[16, 17], [18, 19], [20, 21], [22, 23]]
    assert layout.bundle_resources() == {"GPU": 1.0, "CPU": 1.0}


def test_colocated_layout_shares_the_trainer_bundles(tmp_path):
    args = parse(
        tmp_path,
        "--colocate",
        "--rollout-engine", "sglang",
        "--actor-num-gpus-per-node", "8",
        "--rollout-num-gpus", "16",
        "--rollout-num-gpus-per-engine", "4",
    )  # fmt: skip
    layout = plan_layout(args, use_gpu=True)
    assert layout.num_bundles == 8
    assert layout.engine_bundles() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_cpu_layout_of_the_demo(tmp_path):
    args = parse(tmp_path, "--rollout-engine", "builtin", "--actor-num-gpus-per-node", "2")
    layout = plan_layout(args, use_gpu=False)
    assert layout.bundle_resources() == {"CPU": 1.0}
    assert layout.trainer_bundles() == [0, 1]
    assert layout.engine_bundles() == [[2]]


def _layout(tmp_path, *flags, use_gpu=True):
    return plan_layout(parse(tmp_path, "--rollout-engine", "sglang", *flags), use_gpu=use_gpu)


def test_an_engine_never_spans_two_nodes(tmp_path):
    """Two nodes with 3 free GPUs each after the trainer: a 2-GPU engine must not take one GPU
    of each (a PACK group alone would split it)."""
    layout = _layout(
        tmp_path,
        "--actor-num-gpus-per-node", "1",
        "--rollout-num-gpus", "4",
        "--rollout-num-gpus-per-engine", "2",
        "--num-gpus-per-node", "3",
    )  # fmt: skip
    nodes = assign_nodes(layout, {"10.0.0.2": 3, "10.0.0.1": 3})
    assert nodes[0] == "10.0.0.1"  # the trainer on the first node by address
    for engine in layout.engine_bundles():
        assert len({nodes[b] for b in engine}) == 1
    assert [nodes[b[0]] for b in layout.engine_bundles()] == ["10.0.0.1", "10.0.0.2"]


def test_num_gpus_per_node_caps_what_a_node_holds(tmp_path):
    """--num-gpus-per-node 4 on 8-GPU nodes: no node gets more than 4 of the job's bundles,
    and each trainer node is a node of its own."""
    layout = _layout(
        tmp_path,
        "--actor-num-nodes", "2",
        "--actor-num-gpus-per-node", "2",
        "--rollout-num-gpus", "4",
        "--rollout-num-gpus-per-engine", "2",
        "--num-gpus-per-node", "4",
    )  # fmt: skip
    capacities = {f"10.0.0.{i}": 8 for i in (1, 2, 3)}
    nodes = assign_nodes(layout, capacities)
    assert nodes[:4] == ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"]
    assert max(nodes.count(n) for n in capacities) <= 4
    assert nodes_needed(layout) == 2  # each engine fills a trainer node's remaining 2


def test_a_layout_that_cannot_fit_is_refused_naming_what(tmp_path):
    layout = _layout(
        tmp_path,
        "--actor-num-gpus-per-node", "2",
        "--rollout-num-gpus", "2",
        "--rollout-num-gpus-per-engine", "2",
        "--num-gpus-per-node", "2",
    )  # fmt: skip
    assert nodes_needed(layout) == 2
    with pytest.raises(LayoutDoesNotFit) as info:
        assign_nodes(layout, {"10.0.0.1": 2, "10.0.0.2": 1, "10.0.0.3": 1})
    message = str(info.value)
    assert "needs 2 node(s) of --num-gpus-per-node 2" in message
    assert "engine 0 (2 GPU(s)) fits no node" in message
    assert "10.0.0.2': 1" in message
    with pytest.raises(LayoutDoesNotFit, match="trainer node 0"):
        assign_nodes(layout, {"10.0.0.1": 1})


def test_colocated_engines_stay_inside_a_trainer_node(tmp_path):
    with pytest.raises(ArgumentError, match="does not divide --actor-num-gpus-per-node 3"):
        _layout(
            tmp_path,
            "--colocate",
            "--actor-num-nodes", "2",
            "--actor-num-gpus-per-node", "3",
            "--rollout-num-gpus-per-engine", "2",
        )  # fmt: skip


def test_a_trainer_node_takes_the_first_node_with_room(tmp_path):
    layout = _layout(
        tmp_path,
        "--actor-num-gpus-per-node", "2",
        "--rollout-num-gpus", "1",
        "--num-gpus-per-node", "2",
    )  # fmt: skip
    assert assign_nodes(layout, {"10.0.0.1": 1, "10.0.0.2": 2}) == [
        "10.0.0.2",
        "10.0.0.2",
        "10.0.0.1",
    ]
