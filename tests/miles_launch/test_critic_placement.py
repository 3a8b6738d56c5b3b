"""A critic on its own ranks (``--critic-num-nodes`` / ``--critic-num-gpus-per-node``) at
argument time and in the bundle plan: where its bundles go (after the trainer's, before the
engines', never shared with colocated engines), which nodes they take, and the one-line
refusals of a critic world its backend cannot build. The job itself (its own processes, its own
data-parallel degree, the metrics of the shared layout) is test_critic_own_ranks_e2e.py's."""

from __future__ import annotations

import pytest
from launch_testing import one_error_line, run_cli
from launch_testing import parse as parse_launch
from miles_core import backends
from miles_core.args import ArgumentError, entry_point_groups, parse_args
from miles_launch.placement import LayoutDoesNotFit, assign_nodes, nodes_needed, plan_layout
from miles_launch.plan import critic_line

PPO = ["--advantage-estimator", "ppo", "--use-critic"]


def parse(tmp_path, *flags: str):
    """The launch flags under FSDP, the backend a critic on its own ranks is proven with."""
    return parse_launch(tmp_path, "--train-backend", "fsdp", *flags)


def _layout(tmp_path, *flags, use_gpu=True):
    return plan_layout(parse(tmp_path, "--rollout-engine", "sglang", *flags), use_gpu=use_gpu)


def test_without_critic_flags_the_critic_adds_no_bundle(tmp_path):
    layout = _layout(tmp_path, *PPO, "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2")
    assert layout.num_critic_ranks == 0 and layout.critic_bundles() == []
    assert layout.num_bundles == 4 and layout.engine_bundles() == [[2], [3]]


def test_disaggregated_critic_bundles_sit_between_trainer_and_engines(tmp_path):
    """4 trainer ranks, a critic of 2 nodes x 2, two 2-GPU engines on two 8-GPU nodes: each
    critic node group takes a node of its own (the first may be the trainer's), engines fill
    what is left."""
    args = parse(
        tmp_path, *PPO, "--rollout-engine", "sglang",
        "--actor-num-gpus-per-node", "4",
        "--critic-num-nodes", "2", "--critic-num-gpus-per-node", "2",
        "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2",
    )  # fmt: skip
    layout = plan_layout(args, use_gpu=True)
    assert layout.trainer_bundles() == [0, 1, 2, 3]
    assert layout.critic_bundles() == [4, 5, 6, 7]
    assert layout.engine_bundles() == [[8, 9], [10, 11]]
    assert layout.num_bundles == 12
    nodes = assign_nodes(layout, {"10.0.0.1": 8, "10.0.0.2": 8})
    assert nodes[:4] == ["10.0.0.1"] * 4  # the trainer
    assert nodes[4:8] == ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"]  # critic nodes 0, 1
    assert [nodes[b[0]] for b in layout.engine_bundles()] == ["10.0.0.1", "10.0.0.2"]
    assert nodes_needed(layout) == 2
    line = critic_line(args, layout)
    assert line is not None and line.startswith("critic: its own 4 rank(s) on 2 node(s)")


def test_a_critic_node_that_fits_nowhere_is_named(tmp_path):
    layout = _layout(
        tmp_path, *PPO, "--actor-num-gpus-per-node", "2", "--critic-num-nodes", "2",
        "--critic-num-gpus-per-node", "2", "--num-gpus-per-node", "4",
    )  # fmt: skip
    with pytest.raises(LayoutDoesNotFit, match=r"critic node 1 \(2 GPU\(s\)\) fits no node"):
        assign_nodes(layout, {"10.0.0.1": 4})  # critic nodes 0 and 1 may not share a node


def test_colocated_engines_use_the_trainer_gpus_only(tmp_path):
    """--colocate: the engines share the trainer's bundles (--rollout-num-gpus reconciled to the
    trainer's 2 GPUs); the critic's bundle is its own, counted in the job's total."""
    layout = _layout(
        tmp_path, *PPO, "--colocate", "--actor-num-gpus-per-node", "2",
        "--critic-num-gpus-per-node", "1",
    )  # fmt: skip
    assert layout.num_bundles == 3
    assert layout.engine_bundles() == [[0], [1]]
    assert layout.critic_bundles() == [2]


def test_an_unset_critic_flag_takes_the_actors_value(tmp_path):
    args = parse(
        tmp_path, *PPO, "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "3",
        "--critic-num-gpus-per-node", "1",
    )  # fmt: skip
    assert (args.critic_num_nodes, args.critic_num_gpus_per_node) == (2, 1)
    layout = plan_layout(args, use_gpu=False)
    assert layout.num_critic_ranks == 2 and layout.critic_gpus_per_node == 1
    args = parse(tmp_path, *PPO, "--actor-num-gpus-per-node", "2", "--critic-num-nodes", "2")
    assert (args.critic_num_nodes, args.critic_num_gpus_per_node) == (2, 2)
    shared = parse(tmp_path, *PPO, "--actor-num-gpus-per-node", "2")
    assert (shared.critic_num_nodes, shared.critic_num_gpus_per_node) == (None, None)


def _parse_with(backend: str, tmp_path, *flags: str):
    hf = tmp_path / "hf"
    hf.mkdir(exist_ok=True)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi", "label": "1"}\n')
    argv = ["--train-backend", backend, "--hf-checkpoint", str(hf), "--prompt-data", str(prompts)]
    argv += flags
    return parse_args(argv, entry_point_groups("core", "launch", backend))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--critic-num-gpus-per-node", "0"], "--critic-num-gpus-per-node must be >= 1"),
        (["--critic-num-nodes", "0"], "--critic-num-nodes must be >= 1"),
        (
            ["--critic-num-gpus-per-node", "2", "--num-gpus-per-node", "1"],
            "--critic-num-gpus-per-node 2 exceeds --num-gpus-per-node 1",
        ),
    ],
)
def test_bad_critic_placement_is_one_line(tmp_path, flags, message):
    with pytest.raises(ArgumentError) as info:
        parse(tmp_path, *PPO, *flags)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_fsdp_replicas_must_divide_the_critic_world(tmp_path):
    if "fsdp" not in backends.available():
        pytest.skip("the FSDP backend is not installed")
    flags = [*PPO, "--actor-num-gpus-per-node", "2", "--dp-replicate-size", "2"]
    assert _parse_with("fsdp", tmp_path, *flags, "--critic-num-gpus-per-node", "2")
    with pytest.raises(ArgumentError) as info:
        _parse_with("fsdp", tmp_path, *flags, "--critic-num-gpus-per-node", "1")
    assert str(info.value) == (
        "the critic's 1 rank(s) (--critic-num-nodes x --critic-num-gpus-per-node) are not "
        "divisible by --dp-replicate-size 2"
    )


def test_megatron_and_fully_async_keep_the_critic_on_the_trainers_ranks(tmp_path):
    """Not proven end to end yet: refused in one line, the shared critic still accepted."""
    refused = "a critic on its own ranks (--critic-num-nodes / --critic-num-gpus-per-node) with "
    megatron = ["--train-backend", "megatron", *PPO, "--actor-num-gpus-per-node", "2"]
    assert parse_launch(tmp_path, *megatron)
    with pytest.raises(ArgumentError) as info:
        parse_launch(tmp_path, *megatron, "--critic-num-gpus-per-node", "1")
    assert str(info.value).startswith(refused + "--train-backend megatron is not supported")
    assert parse(tmp_path, *PPO, "--fully-async")
    with pytest.raises(ArgumentError) as info:
        parse(tmp_path, *PPO, "--fully-async", "--critic-num-gpus-per-node", "1")
    assert str(info.value).startswith(refused + "--fully-async is not supported")
    assert "\n" not in str(info.value)


def test_cli_refuses_a_critic_world_in_one_line():
    """Through ``miles train`` itself: exit status 2, one ``error:`` line."""
    if "fsdp" not in backends.available():
        pytest.skip("the FSDP backend is not installed")
    result = run_cli(
        "train", "--train-backend", "fsdp", *PPO, "--actor-num-gpus-per-node", "2",
        "--dp-replicate-size", "2", "--critic-num-gpus-per-node", "3",
    )  # fmt: skip
    line = one_error_line(result)
    assert "the critic's 3 rank(s)" in line and "--dp-replicate-size 2" in line


def test_the_memory_plan_counts_the_critic_where_it_runs(tmp_path):
    """The trainer GPU's estimate holds a critic beside the actor, not one on its own GPUs."""
    if "fsdp" not in backends.available():
        pytest.skip("the FSDP backend is not installed")
    from miles_launch.memory_plan import trainer_layout

    flags = [*PPO, "--max-tokens-per-gpu", "64"]
    shared = trainer_layout(_parse_with("fsdp", tmp_path, *flags), on_cuda=True)
    own = _parse_with("fsdp", tmp_path, *flags, "--critic-num-gpus-per-node", "1")
    assert shared is not None and shared.critic
    layout = trainer_layout(own, on_cuda=True)
    assert layout is not None and not layout.critic


def test_the_local_gpu_check_counts_the_critics_gpus(tmp_path, monkeypatch):
    """Without --ray-address the job's bundles must fit this machine's GPUs: 2 trainer ranks,
    1 critic rank and 1 engine need 4 (3 without the critic's own rank)."""
    import miles_launch.preflight as preflight_module

    monkeypatch.setattr(preflight_module, "local_gpus", lambda: 3)
    flags = [*PPO, "--rollout-engine", "sglang", "--actor-num-gpus-per-node", "2"]
    preflight_module.check_local_devices(parse(tmp_path, *flags))  # 3 fit
    with pytest.raises(ArgumentError) as info:
        preflight_module.check_local_devices(
            parse(tmp_path, *flags, "--critic-num-gpus-per-node", "1")
        )
    assert str(info.value).startswith(
        "the job needs 4 GPUs (2 trainer ranks + 1 critic + 1 for engines) and this machine has 3"
    )
