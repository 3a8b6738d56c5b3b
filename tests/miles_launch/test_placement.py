"""Bundle layout arithmetic: disaggregated and colocated jobs."""

from __future__ import annotations

from launch_testing import parse
from miles_launch.placement import plan_layout


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
