"""The launcher's argument groups: defaults derived from --colocate, one-line errors."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from launch_testing import parse
from miles_core import backends
from miles_core.args import ArgumentError, installed_groups
from miles_launch.args import launch_groups


def test_launch_groups_are_installed_under_the_launch_entry_point():
    assert all(group in installed_groups() for group in launch_groups())


def test_disaggregated_defaults(tmp_path):
    args = parse(tmp_path, "--rollout-engine", "builtin")
    assert args.rollout_num_gpus == 1  # one engine of --rollout-num-gpus-per-engine
    assert args.offload_train is False and args.offload_rollout is False
    assert args.sglang_mem_fraction_static is None
    assert args.update_weight_transfer_mode == "broadcast"  # resolved at parse time


def test_colocate_reconciles_rollout_gpus_and_turns_offload_on(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        args = parse(
            tmp_path,
            "--colocate",
            "--rollout-engine", "sglang",
            "--actor-num-gpus-per-node", "4",
            "--rollout-num-gpus", "2",
            "--rollout-num-gpus-per-engine", "2",
        )  # fmt: skip
    assert args.rollout_num_gpus == 4
    assert "--rollout-num-gpus 2 ignored" in caplog.text
    assert args.offload_train is True and args.offload_rollout is True
    assert args.sglang_mem_fraction_static == 0.8
    assert args.sglang_passthrough["cuda-graph-backend-prefill"] == "disabled"


def test_colocate_keeps_explicit_values_and_warns_on_no_offload(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        args = parse(
            tmp_path,
            "--colocate",
            "--rollout-engine", "sglang",
            "--no-offload-train",
            "--sglang-mem-fraction-static", "0.6",
            "--sglang-cuda-graph-backend-prefill", "fa3",
        )  # fmt: skip
    assert args.offload_train is False and args.offload_rollout is True
    assert args.sglang_mem_fraction_static == 0.6
    assert args.sglang_passthrough["cuda-graph-backend-prefill"] == "fa3"
    assert "--colocate with --no-offload-train" in caplog.text


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--colocate", "--fully-async"], "--fully-async cannot be used with --colocate"),
        (
            ["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"],
            "--rollout-num-gpus 3 is not a multiple of --rollout-num-gpus-per-engine 2",
        ),
        (
            ["--actor-num-gpus-per-node", "4", "--num-gpus-per-node", "2"],
            "--actor-num-gpus-per-node 4 exceeds --num-gpus-per-node 2",
        ),
        (["--sglang-router-ip", "10.0.0.1"], "--sglang-router-ip and --sglang-router-port"),
        (["--rm-type", "math", "--custom-rm-path", "m:f"], "mutually exclusive"),
        (["--custom-rm-path", "nofunction"], "expected MODULE:FUNCTION"),
        (
            ["--rm-type", "math", "--rm-url", "http://h:1"],
            "--rm-type and --rm-url are mutually exclusive",
        ),
        (["--rm-url", "h:1/score"], "--rm-url 'h:1/score': expected an http:// or https:// URL"),
        (["--rm-url", "http://h:1", "--rm-timeout", "0"], "--rm-timeout must be > 0"),
        (["--rm-url", "http://h:1", "--rm-max-retries", "-1"], "--rm-max-retries must be >= 0"),
        (["--custom-rm-batch", "group"], "--custom-rm-batch group requires --custom-rm-path"),
        (
            ["--custom-rm-path", "m:f", "--custom-rm-batch", "rollout", "--fully-async"],
            "--custom-rm-batch rollout cannot be used with --fully-async",
        ),
        (["--eval-interval", "2"], "--eval-interval requires --eval-prompt-data"),
        (["--rollout-top-p", "0"], "--rollout-top-p must be in (0, 1]"),
        (["--sglang-tp-size", "2"], "--sglang-tp-size is set by miles"),
        (
            ["--rollout-engine", "builtin", "--rollout-num-gpus-per-engine", "2"],
            "the built-in engine serves on one device",
        ),
    ],
)
def test_bad_combinations_are_one_line_errors(tmp_path, flags, message):
    with pytest.raises(ArgumentError) as info:
        parse(tmp_path, *flags)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_checks_see_the_engine_the_job_will_use(tmp_path):
    """No --rollout-engine: the engine is resolved before validation, so a layout the resolved
    engine cannot serve is refused (before, the check saw None and passed it)."""
    from miles_launch.args import sglang_importable

    if sglang_importable():
        args = parse(tmp_path, "--rollout-num-gpus-per-engine", "2")
        assert args.rollout_engine == "sglang"
        return
    with pytest.raises(ArgumentError, match="the built-in engine serves on one device"):
        parse(tmp_path, "--rollout-num-gpus-per-engine", "2")


def test_missing_prompt_file_names_the_flag(tmp_path):
    with pytest.raises(ArgumentError, match="--prompt-data .*nope.jsonl: no such file"):
        parse(tmp_path, "--prompt-data", str(tmp_path / "nope.jsonl"))


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "miles_launch.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_cli_flag_combination_error_is_one_line_exit_2():
    if "fsdp" not in backends.available():
        pytest.skip("the FSDP backend is not installed")
    line = _one_error_line(_cli("train", "--train-backend", "fsdp", "--colocate", "--fully-async"))
    assert "--fully-async cannot be used with --colocate" in line


def test_cli_unknown_backend_and_command_exit_2():
    assert "'nosuch'" in _one_error_line(_cli("train", "--train-backend", "nosuch"))
    assert "unknown command 'serve'" in _one_error_line(_cli("serve"))


def test_cli_help_lists_every_flag():
    shown = _cli("train", "--help")
    assert shown.returncode == 0
    names = [
        "--actor-num-gpus-per-node", "--rollout-num-gpus", "--prompt-data", "--fully-async",
        "--sglang-router-ip", "--lr", "--colocate", "--rm-type", "--update-weight-transfer-mode",
    ]  # fmt: skip
    for name in names:
        assert name in shown.stdout
