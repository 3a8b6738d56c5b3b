"""``--use-critic``, ``--advantage-estimator ppo`` and ``--loss-type`` at argument time: every bad
combination is one line naming the flags (exit status 2 from the CLI), before anything starts."""

from __future__ import annotations

import pytest
from launch_testing import one_error_line, parse, run_cli
from miles_core import backends
from miles_core.args import ArgumentError
from miles_core.args.groups.critic import critic_args

PPO = ["--advantage-estimator", "ppo", "--use-critic"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--advantage-estimator", "ppo"],
            "--advantage-estimator ppo needs --use-critic",
        ),
        (["--use-critic"], "--use-critic: only --advantage-estimator ppo uses"),
        (["--critic-lr", "1e-5"], "--critic-lr requires --use-critic"),
        (["--critic-save", "/x"], "--critic-save requires --use-critic"),
        (["--num-critic-only-steps", "2"], "--num-critic-only-steps requires --use-critic"),
        ([*PPO, "--num-critic-only-steps", "-1"], "--num-critic-only-steps must be >= 0"),
        (
            ["--loss-type", "nft"],
            "--loss-type nft (EMA as pi_old) is offered for causal LMs as --old-policy ema",
        ),  # fmt: skip
        (["--loss-type", "value_loss"], "--loss-type value_loss is the critic's loss"),
        ([*PPO, "--loss-type", "sft_loss"], "--use-critic trains the actor with --loss-type"),
        ([*PPO, "--kl-coef", "0.1", "--ref-load", "/x"], "--use-critic with --kl-coef > 0"),
        (
            [*PPO, "--train-backend", "fsdp", "--critic-num-gpus-per-node", "9"],
            "--critic-num-gpus-per-node 9 exceeds --num-gpus-per-node 8",
        ),
        (["--critic-num-nodes", "1"], "--critic-num-nodes requires --use-critic"),
    ],
)
def test_bad_critic_combinations_are_one_line_errors(tmp_path, flags, message):
    with pytest.raises(ArgumentError) as info:
        parse(tmp_path, *flags)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_a_critic_runs_under_fully_async(tmp_path):
    """``--fully-async --use-critic`` parses (the async loop runs the critic phase)."""
    args = parse(tmp_path, *PPO, "--fully-async")
    assert args.fully_async and args.use_critic


def test_critic_flags_and_checkpoint_directories(tmp_path):
    args = parse(
        tmp_path, *PPO, "--lr", "1e-6", "--critic-lr", "1e-5", "--critic-lr-warmup-iters", "3",
        "--save", str(tmp_path / "ck"), "--load", str(tmp_path / "ck"),
        "--train-backend", "fsdp", "--critic-num-gpus-per-node", "1", "--value-clip", "0.5",
        "--tensorboard-dir", str(tmp_path / "tb"),
    )  # fmt: skip
    assert args.critic_save == str(tmp_path / "ck" / "critic")
    assert args.critic_load == str(tmp_path / "ck" / "critic")
    critic = critic_args(args)
    assert (critic.lr, critic.lr_warmup_iters, critic.loss_type) == (1e-5, 3, "value_loss")
    assert (critic.save, critic.load) == (args.critic_save, args.critic_load)
    assert critic.tensorboard_dir == str(tmp_path / "tb" / "critic")
    assert (critic.load_rng, critic.use_lora, critic.use_ema, critic.ref_mode) == (
        False, False, False, "none",
    )  # fmt: skip
    assert (args.lr, args.lr_warmup_iters, args.loss_type) == (1e-6, 0, "policy_loss")
    explicit = parse(tmp_path, *PPO, "--save", "/a", "--critic-save", "/b")
    assert explicit.critic_save == "/b" and explicit.critic_load is None
    assert critic_args(parse(tmp_path, *PPO, "--lr", "2e-3")).lr == 2e-3


def test_cli_ppo_without_critic_and_nft_exit_2():
    if "fsdp" not in backends.available():
        pytest.skip("the FSDP backend is not installed")
    line = one_error_line(
        run_cli("train", "--train-backend", "fsdp", "--advantage-estimator", "ppo")
    )
    assert "--advantage-estimator ppo" in line and "--use-critic" in line
    line = one_error_line(run_cli("train", "--train-backend", "fsdp", "--loss-type", "nft"))
    assert "--old-policy ema" in line


@pytest.mark.slow
def test_cli_megatron_refuses_a_critic_checkpoint_in_one_line(tmp_path):
    """The Megatron critic shares the actor's architecture: ``--critic-hf-checkpoint`` is
    refused by ``miles train`` in one line, exit status 2."""
    if "megatron" not in backends.available():
        pytest.skip("the Megatron backend is not installed")
    other = _hf_dir(tmp_path / "critic", 64)
    result = run_cli("train", "--train-backend", "megatron", *PPO, "--critic-hf-checkpoint", other)
    assert result.returncode == 2, result.stderr  # (megatron-core's import warnings come first)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, errors
    assert "--critic-hf-checkpoint is not supported by the Megatron backend" in errors[0], errors


def _hf_dir(path, vocab_size, architecture="Qwen3ForCausalLM"):
    import json

    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": [architecture], "vocab_size": vocab_size}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_critic_hf_checkpoint(tmp_path):
    """--critic-hf-checkpoint: the critic's namespace builds from it (--critic-load keeps
    meaning the checkpoint to resume from); a missing config, a head other than a causal LM's
    or another vocabulary are one line at argument time."""
    _hf_dir(tmp_path / "hf", 64)  # the actor's (launch_testing.parse's --hf-checkpoint)
    other = _hf_dir(tmp_path / "other", 64)
    args = parse(tmp_path, *PPO, "--critic-hf-checkpoint", other, "--load", str(tmp_path / "ck"))
    critic = critic_args(args)
    assert critic.hf_checkpoint == other and args.hf_checkpoint == str(tmp_path / "hf")
    assert critic.load == str(tmp_path / "ck" / "critic")
    for flags, message in (
        ([str(tmp_path / "nothing")], "no config.json"),
        ([_hf_dir(tmp_path / "rm", 64, "Qwen3ForSequenceClassification")], "is not a causal LM"),
        ([_hf_dir(tmp_path / "v32", 32)], "vocab_size 32 differs from --hf-checkpoint's 64"),
    ):
        with pytest.raises(ArgumentError, match=message):
            parse(tmp_path, *PPO, "--critic-hf-checkpoint", *flags)
    with pytest.raises(ArgumentError, match="--critic-hf-checkpoint requires --use-critic"):
        parse(tmp_path, "--critic-hf-checkpoint", other)


def test_megatron_refuses_critic_hf_checkpoint(tmp_path):
    if "megatron" not in backends.available():
        pytest.skip("the Megatron backend is not installed")
    from miles_core.args import parse_args
    from miles_core.args.registry import entry_point_groups

    other = _hf_dir(tmp_path / "other", 64)
    argv = ["--train-backend", "megatron", "--hf-checkpoint", other, *PPO]
    with pytest.raises(ArgumentError, match="--critic-hf-checkpoint is not supported by the Meg"):
        parse_args([*argv, "--critic-hf-checkpoint", other], entry_point_groups("core", "megatron"))
