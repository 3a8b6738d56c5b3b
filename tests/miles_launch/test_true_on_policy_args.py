"""--true-on-policy on the command line: what it implies, where it is refused (one line naming
the flag and why), and the engine flag the launcher passes."""

from __future__ import annotations

import pytest
from launch_testing import parse
from miles_core import backends
from miles_core.args import ArgumentError, entry_point_groups, parse_args
from miles_launch.engine_launch.builtin_launcher import builtin_engine_command

ON = ("--true-on-policy", "--rollout-engine", "builtin")


def test_it_implies_the_engine_log_probs_and_reaches_the_engine(tmp_path):
    args = parse(tmp_path, *ON)
    assert args.use_rollout_logprobs and args.fused_log_probs  # the mode's own fused head
    assert not parse(tmp_path, *ON, "--no-fused-log-probs").fused_log_probs
    cmd = builtin_engine_command(args, host="127.0.0.1", port=5, device="cpu", python="py")
    assert cmd[-1] == "--true-on-policy"
    plain = parse(tmp_path, "--rollout-engine", "builtin")
    assert "--true-on-policy" not in builtin_engine_command(plain, host="h", port=5, device="cpu")
    assert not plain.use_rollout_logprobs and plain.fused_log_probs


def test_with_sglang_it_passes_sglang_s_own_switches(tmp_path):
    from miles_launch.engine_launch.sglang_launcher import sglang_server_command

    args = parse(tmp_path, "--true-on-policy", "--rollout-engine", "sglang")
    cmd = sglang_server_command(args, host="h", port=5, python="py")
    tail = cmd[cmd.index("--rl-on-policy-target") :]
    assert tail[:5] == [
        "--rl-on-policy-target", "fsdp", "--enable-deterministic-inference",
        "--attention-backend", "fa3",
    ]  # fmt: skip
    plain = sglang_server_command(parse(tmp_path, "--rollout-engine", "sglang"), host="h", port=5)
    assert "--rl-on-policy-target" not in plain and "--enable-deterministic-inference" not in plain


@pytest.mark.parametrize(
    "flags, message",
    [
        ((*ON, "--loss-type", "sft_loss"), "--loss-type sft_loss ignores --true-on-policy"),
    ],
)
def test_refused_where_not_honoured(tmp_path, flags, message):
    with pytest.raises(ArgumentError, match=message):
        parse(tmp_path, *flags)


@pytest.mark.skipif("fsdp" not in backends.available(), reason="the FSDP backend is not installed")
@pytest.mark.parametrize(
    "flags, message",
    [
        (("--attn-implementation", "sdpa"), "--attn-implementation sdpa with --true-on-policy"),
        (
            ("--fp16",),
            "--true-on-policy computes in bf16 \\(GPU\\) or fp32, and the compute dtype is fp16",
        ),
        (("--fsdp-compute-dtype", "fp32", "--bf16"), "contradicts --bf16"),
    ],
)
def test_the_fsdp_backend_refuses_another_attention_or_dtype(tmp_path, flags, message):
    parse(tmp_path)  # writes the prompts and the HF directory
    common = [
        "--hf-checkpoint",
        str(tmp_path / "hf"),
        "--prompt-data",
        str(tmp_path / "prompts.jsonl"),
    ]
    groups = entry_point_groups("core", "launch", "fsdp")
    with pytest.raises(ArgumentError, match=message):
        parse_args([*common, *ON, *flags], groups)
    args = parse_args([*common, *ON, "--fsdp-compute-dtype", "fp32"], groups)
    assert args.attn_implementation is None  # the backend takes the mode's own attention
    parse_args([*common, *ON], groups)  # bf16: a GPU's dtype (the backend checks the device)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ("--dtype", "bfloat16"),
            "--true-on-policy computes in float32 on CPU, got --dtype bfloat16",
        ),
        (
            ("--device", "cuda", "--dtype", "float16"),
            "--true-on-policy computes in bfloat16 or float32 on a GPU, got --dtype float16",
        ),
    ],
)
def test_the_engine_refuses_another_dtype(flags, message):
    from miles_launch.builtin_engine.__main__ import parse_args as engine_args

    with pytest.raises(ArgumentError, match=message):
        engine_args(["--model-path", "m", "--true-on-policy", *flags])
    config = engine_args(["--model-path", "m", "--true-on-policy"])
    assert config.dtype == "float32"  # CPU: float32 whatever the checkpoint holds


def test_the_fsdp_backend_checks_the_engine_dtype_on_the_device():
    """On CPU fp32; on a GPU the checkpoint's dtype, which the engine loads (``--dtype auto``)
    and the weights are published in."""
    pytest.importorskip("miles_fsdp")
    import torch
    from miles_fsdp.true_on_policy import check_true_on_policy_dtype

    bf16 = {"w": torch.bfloat16, "b": torch.bfloat16, "ids": torch.int64}
    check_true_on_policy_dtype(torch.device("cpu"), torch.float32, bf16)
    check_true_on_policy_dtype(torch.device("cuda:0"), torch.bfloat16, bf16)
    with pytest.raises(
        ArgumentError, match="computes in fp32 on CPU, and the compute dtype is bf16"
    ):
        check_true_on_policy_dtype(torch.device("cpu"), torch.bfloat16, bf16)
    with pytest.raises(ArgumentError, match="holds bf16 while the compute dtype is fp32"):
        check_true_on_policy_dtype(torch.device("cuda:0"), torch.float32, bf16)
