"""The FSDP argument group: model parallelism rejected, mesh divisibility, exclusions."""

from __future__ import annotations

import pytest
from miles_core.args import ArgumentError
from miles_fsdp.mesh import mesh_shape
from run_args import parse


@pytest.mark.parametrize(
    "option",
    [
        "--tensor-model-parallel-size",
        "--pipeline-model-parallel-size",
        "--context-parallel-size",
        "--expert-model-parallel-size",
        "--expert-tensor-parallel-size",
    ],
)
def test_model_parallel_sizes_point_to_megatron(option):
    with pytest.raises(ArgumentError, match=f"{option} 2: .*--train-backend megatron"):
        parse(option, "2")


def test_defaults_parse(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = parse()
    assert (
        args.dp_replicate_size == 1 and args.keep_fp32_master and args.attn_implementation is None
    )
    assert not parse("--no-keep-fp32-master").keep_fp32_master


def test_dp_replicate_must_divide_world(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    assert parse("--dp-replicate-size", "3").dp_replicate_size == 3
    with pytest.raises(ArgumentError, match="--dp-replicate-size 4 does not divide the 6"):
        parse("--dp-replicate-size", "4")


def test_stream_optimizer_excludes_fsdp_cpu_offload():
    with pytest.raises(ArgumentError, match="--fsdp-cpu-offload"):
        parse(
            "--fsdp-cpu-offload",
            "--stream-optimizer-state-to-disk",
            "--offload-train",
            "--offload-train-target",
            "disk",
        )


def test_profile_window_must_be_ordered():
    with pytest.raises(ArgumentError, match="--profile-step-end"):
        parse("--profile-step-start", "5", "--profile-step-end", "5")


def test_gradient_checkpointing_layers_need_checkpointing():
    with pytest.raises(ArgumentError, match="--gradient-checkpointing-layers needs --gradient-ch"):
        parse("--gradient-checkpointing-layers", "2")
    with pytest.raises(ArgumentError, match="--gradient-checkpointing-layers must be >= 1, got 0"):
        parse("--gradient-checkpointing", "--gradient-checkpointing-layers", "0")
    flags = ("--gradient-checkpointing", "--gradient-checkpointing-layers", "2")
    assert parse(*flags).gradient_checkpointing_layers == 2


def test_mesh_shape():
    assert mesh_shape(8, 2).dp_shard == 4
    with pytest.raises(ValueError, match="does not divide the world size 8"):
        mesh_shape(8, 3)


def test_backend_needs_hf_checkpoint():
    from miles_fsdp.backend import FSDPBackend
    from run_args import make_args

    with pytest.raises(ArgumentError, match="needs --hf-checkpoint"):
        FSDPBackend().init(make_args())


def test_decay_iters_default_to_the_whole_run():
    from miles_core.optimizer import optimizer_config, run_optimizer_steps
    from run_args import make_args

    def decay(args):
        cfg = args.run_config
        return optimizer_config(cfg.optimizer, cfg.offload, run_optimizer_steps(args))

    args = make_args(num_steps_per_rollout=2)
    assert decay(args).lr_decay_iters is None
    args.num_rollout = 10  # the launcher's flag, when it is in the namespace
    assert decay(args).lr_decay_iters == 20
    args = make_args(num_steps_per_rollout=2, lr_decay_iters=7)
    args.num_rollout = 10
    assert decay(args).lr_decay_iters == 7
