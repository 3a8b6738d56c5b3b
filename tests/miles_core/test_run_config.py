"""The typed run configuration ``args.run_config`` (miles_core.args.run_config): built by the real
parser from a real command line, holding the resolved values, frozen, typed per group."""

from __future__ import annotations

import dataclasses

import pytest
from miles_core.args import ArgumentError, RunConfig, core_groups, parse_args
from miles_core.args.groups import AlgorithmArgs, OptimizerArgs, SyncArgs
from miles_core.args.groups.critic import critic_args
from miles_core.losses import LossConfig


def parse(*argv: str):
    return parse_args(list(argv), core_groups())


def test_run_config_holds_each_parsed_group_with_the_resolved_values():
    args = parse("--lr", "2e-6", "--adam-beta2", "0.95", "--colocate")
    cfg = args.run_config
    assert isinstance(cfg, RunConfig)
    assert [type(g) for g in cfg.groups] == core_groups()  # one instance per group, in order
    assert cfg.optimizer is cfg[OptimizerArgs] and isinstance(cfg.optimizer, OptimizerArgs)
    # the values of the command line, and a default where none was given
    assert cfg.optimizer.lr == 2e-6 and cfg.optimizer.adam_beta2 == 0.95
    assert cfg.optimizer.weight_decay == OptimizerArgs.__dataclass_fields__["weight_decay"].default
    # resolve_defaults ran first: --colocate makes the unset transfer mode ipc (DESIGN.md)
    assert cfg.sync.update_weight_transfer_mode == "ipc"
    assert cfg.explicit_flags == frozenset({"lr", "adam_beta2", "colocate"})
    # every field of every group equals the namespace's attribute
    for group in cfg.groups:
        for field in dataclasses.fields(group):
            assert getattr(group, field.name) == vars(args)[field.name], field.name


def test_run_config_is_frozen():
    cfg = parse().run_config
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optimizer.lr = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.groups = ()  # type: ignore[misc]


def test_a_group_not_parsed_is_none_from_get_and_an_error_naming_it_from_index():
    @dataclasses.dataclass(frozen=True)
    class ElsewhereArgs(OptimizerArgs):  # a group of another package, never parsed here
        pass

    cfg = parse().run_config
    assert cfg.get(ElsewhereArgs) is None and ElsewhereArgs not in cfg
    assert cfg.get(SyncArgs) is cfg.sync and SyncArgs in cfg
    with pytest.raises(KeyError, match="argument group ElsewhereArgs was not parsed"):
        cfg[ElsewhereArgs]


def test_the_critics_namespace_carries_its_own_run_config():
    args = parse(
        "--use-critic", "--advantage-estimator", "ppo", "--critic-lr", "3e-5",
        "--use-rollout-logprobs",
    )  # fmt: skip
    critic = critic_args(args)
    assert critic.run_config.optimizer.lr == 3e-5 and args.run_config.optimizer.lr != 3e-5
    assert critic.run_config.algorithm.loss_type == "value_loss"
    assert args.run_config.algorithm.use_rollout_logprobs
    assert not critic.run_config.algorithm.use_rollout_logprobs


def test_loss_config_is_the_algorithm_groups_values_and_defaults():
    args = parse("--advantage-estimator", "reinforce_plus_plus", "--rollout-temperature", "0.8")
    loss = LossConfig.from_algorithm(args.run_config.algorithm)
    assert loss.advantage_estimator == "reinforce_plus_plus" and loss.temperature == 0.8
    # LossConfig() declares no default of its own: each is AlgorithmArgs'
    algorithm_defaults = {f.name: f.default for f in dataclasses.fields(AlgorithmArgs)}
    for field in dataclasses.fields(LossConfig):
        flag = "rollout_temperature" if field.name == "temperature" else field.name
        assert getattr(LossConfig(), field.name) == algorithm_defaults[flag], field.name


@pytest.mark.parametrize(("low", "clip"), [("2.0", "2.0"), ("2.5", "2.0"), ("-0.1", "2.0")])
def test_tis_clip_bounds_are_one_rule_for_the_flags_and_the_loss_config(low, clip):
    """0 <= --tis-clip-low < --tis-clip: equal bounds (the old drift: <= in the loss config)
    are refused by both, with the same words."""
    with pytest.raises(ArgumentError) as flags:
        parse("--use-tis", "--tis-clip-low", low, "--tis-clip", clip)
    with pytest.raises(ValueError) as loss:
        LossConfig(use_tis=True, tis_clip_low=float(low), tis_clip=float(clip))
    assert str(flags.value) == str(loss.value)
    assert "--tis-clip-low" in str(loss.value)
    # the valid neighbour passes both
    parse("--use-tis", "--tis-clip-low", "0.5", "--tis-clip", clip)
    LossConfig(use_tis=True, tis_clip_low=0.5, tis_clip=float(clip))
