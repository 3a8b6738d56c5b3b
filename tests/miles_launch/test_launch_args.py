"""The launcher's argument groups: defaults derived from --colocate, one-line errors."""

from __future__ import annotations

import logging

import pytest
from launch_testing import one_error_line, parse, run_cli
from miles_core import backends
from miles_core.args import ArgumentError, entry_point_groups, installed_groups
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
        (["--max-weight-staleness", "1"], "--max-weight-staleness bounds --fully-async's samples"),
        (["--fully-async", "--max-weight-staleness", "-1"], "--max-weight-staleness must be >= 0"),
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


def test_cli_flag_combination_error_is_one_line_exit_2():
    if "fsdp" not in backends.available():
        pytest.skip("the FSDP backend is not installed")
    line = one_error_line(
        run_cli("train", "--train-backend", "fsdp", "--colocate", "--fully-async")
    )
    assert "--fully-async cannot be used with --colocate" in line


def test_cli_unknown_backend_and_command_exit_2():
    assert "'nosuch'" in one_error_line(run_cli("train", "--train-backend", "nosuch"))
    assert "unknown command 'serve'" in one_error_line(run_cli("serve"))


def test_cli_help_all_lists_every_flag():
    shown = run_cli("train", "--help-all")
    assert shown.returncode == 0
    names = [
        "--actor-num-gpus-per-node", "--rollout-num-gpus", "--prompt-data", "--fully-async",
        "--sglang-router-ip", "--lr", "--colocate", "--rm-type", "--update-weight-transfer-mode",
    ]  # fmt: skip
    for name in names:
        assert name in shown.stdout
    text = " ".join(shown.stdout.split())  # argparse wraps the epilog
    assert shown.stdout.startswith("usage: miles train [flags]")
    # the default backend's flags, and how to list the other backend's
    assert "Listed: the flags of --train-backend megatron." in text
    assert "`miles train --train-backend fsdp --help` lists fsdp's" in text


def test_a_misspelt_flag_is_answered_with_the_flag_meant():
    line = one_error_line(run_cli("train", "--train-backend", "fsdp", "--gradient-checkpointin"))
    assert line == (
        "error: unrecognized flag --gradient-checkpointin (did you mean --gradient-checkpointing "
        "or --gradient-checkpointing-layers?)"
    )  # the closest first


# ------------------------------------------------------------------ rollout control (#30)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--over-sampling-batch-size", "16"],
            "--over-sampling-batch-size requires --dynamic-filter",
        ),
        (
            ["--dynamic-filter", "--rollout-batch-size", "8", "--over-sampling-batch-size", "4"],
            "--over-sampling-batch-size 4 is smaller than --rollout-batch-size 8",
        ),
        (["--rollout-stop-token-ids", "3", "-1"], "--rollout-stop-token-ids: -1 is not a token id"),
        (["--rollout-stop", ""], "--rollout-stop: empty list item"),
        (["--rollout-max-prompt-len", "0"], "--rollout-max-prompt-len must be >= 1"),
        (["--rollout-seed", "-3"], "--rollout-seed must be >= 0"),
        (["--custom-generate-function-path", "nodots"], "expected MODULE:FUNCTION or MODULE.FUNC"),
        (
            ["--custom-generate-function-path", "no_such_module_30:gen"],
            "--custom-generate-function-path no_such_module_30:gen: cannot import no_such_module_30",
        ),
        (
            ["--custom-generate-function-path", "json:nothing_here"],
            "--custom-generate-function-path json:nothing_here: json has no function nothing_here",
        ),
        (
            ["--custom-generate-function-path", "json.dumps"],
            "--custom-generate-function-path json.dumps: dumps must be an async function",
        ),
    ],
)
def test_rollout_control_errors_are_one_line(tmp_path, flags, message):
    with pytest.raises(ArgumentError) as info:
        parse(tmp_path, *flags)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_stop_token_ids_outside_the_vocabulary_are_refused(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"vocab_size": 40}')
    assert parse(tmp_path, "--rollout-stop-token-ids", "39").rollout_stop_token_ids == [39]
    with pytest.raises(ArgumentError, match=r"--rollout-stop-token-ids: 40 is outside the voc"):
        parse(tmp_path, "--rollout-stop-token-ids", "3,40")


def test_rollout_control_values_and_defaults(tmp_path):
    from miles_launch.loop import eval_sampling_config, sampling_config

    args = parse(tmp_path, "--seed", "7")
    assert args.rollout_seed == 7  # unset: --seed
    assert sampling_config(args).stop == () and sampling_config(args).stop_token_ids == ()
    args = parse(
        tmp_path,
        "--seed", "7",
        "--rollout-seed", "11",
        "--rollout-stop", "ab", "c",
        "--rollout-stop-token-ids", "3,4",
        "--dynamic-filter",
        "--rollout-batch-size", "4",
        "--over-sampling-batch-size", "6",
        "--custom-generate-function-path", "asyncio.sleep",
    )  # fmt: skip
    cfg = sampling_config(args)
    assert (cfg.seed, cfg.stop, cfg.stop_token_ids) == (11, ("ab", "c"), (3, 4))
    assert eval_sampling_config(args).seed == 11
    assert args.over_sampling_batch_size == 6


def test_cli_rollout_control_error_is_one_line_exit_2():
    if "fsdp" not in backends.available():
        pytest.skip("the FSDP backend is not installed")
    line = one_error_line(
        run_cli("train", "--train-backend", "fsdp", "--over-sampling-batch-size", "16")
    )
    assert "--over-sampling-batch-size requires --dynamic-filter" in line


@pytest.mark.parametrize(
    "flags, gpu_backend",
    [
        ((), "nccl"),
        (("--fsdp-cpu-offload",), "cpu:gloo,cuda:nccl"),
        (("--ref-load", "REF", "--ref-cpu-offload"), "cpu:gloo,cuda:nccl"),
    ],
)
def test_cpu_offload_flags_put_a_cpu_backend_beside_nccl(tmp_path, flags, gpu_backend):
    """`miles train`'s default group: NCCL alone, or with the CPU backend of
    --fsdp-cpu-backend when a flag keeps shards on the host (gloo without a GPU)."""
    from miles_core.args import parse_args
    from miles_fsdp.args import fsdp_groups
    from miles_launch.trainer_group import process_group_backend

    (tmp_path / "REF").mkdir()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi", "label": "1"}\n')
    (tmp_path / "hf").mkdir()
    flags = tuple(str(tmp_path / "REF") if f == "REF" else f for f in flags)
    argv = ["--hf-checkpoint", str(tmp_path / "hf"), "--prompt-data", str(prompts), *flags]
    args = parse_args(argv, [*entry_point_groups("core", "launch"), *fsdp_groups()])
    assert process_group_backend(args, use_gpu=True) == gpu_backend
    assert process_group_backend(args, use_gpu=False) == "gloo"
