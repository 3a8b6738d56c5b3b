"""Every argument error of the FSDP model roles (reference, teacher, LoRA, EMA), one case each,
through the FSDP backend's command line (core + FSDP groups): the exact one-line message, and
exit status 2 from the CLI entry. Errors raised while loading (adapter files, model family,
component count) are tested next to their code in test_lora.py and test_roles.py."""

from __future__ import annotations

import pytest
from miles_core.args import ArgumentError, core_groups, parse_args_or_exit
from miles_fsdp.args import fsdp_groups
from run_args import parse

HOOK = ["--custom-prepare-path", "role_programs:record_prepare"]

ERRORS = {
    "kl term, explicit --ref-mode none": (
        ["--use-lora", "--use-kl-loss", "--ref-mode", "none"],
        "a KL term (--use-kl-loss or --kl-coef > 0) needs a reference, but --ref-mode none: "
        "pass --ref-load, or --use-lora with --ref-mode lora_base",
    ),
    "kl term, derived mode none": (
        ["--kl-coef", "0.05"],
        "a KL term (--use-kl-loss or --kl-coef > 0) needs a reference, but no --ref-load (and "
        "no --use-lora): pass --ref-load, or --use-lora with --ref-mode lora_base",
    ),
    "ref without --ref-load": (["--ref-mode", "ref"], "--ref-mode ref requires --ref-load"),
    "--ref-load with --ref-mode none": (
        ["--ref-load", "/r", "--ref-mode", "none"],
        "--ref-load needs --ref-mode ref (or no --ref-mode), not none",
    ),
    "--ref-load with --ref-mode lora_base": (
        ["--ref-load", "/r", "--ref-mode", "lora_base", "--use-lora"],
        "--ref-load needs --ref-mode ref (or no --ref-mode), not lora_base",
    ),
    "ref adapter without --ref-load": (
        ["--ref-lora-adapter-path", "/a"],
        "--ref-lora-adapter-path requires --ref-load",
    ),
    "--ref-cpu-offload without --ref-load": (
        ["--ref-cpu-offload"],
        "--ref-cpu-offload requires --ref-load",
    ),
    "lora_base without --use-lora": (
        ["--ref-mode", "lora_base"],
        "--ref-mode lora_base requires --use-lora",
    ),
    "teacher without a hook": (
        ["--teacher-load", "/t"],
        "--teacher-load has no built-in consumer: it requires --custom-prepare-path or "
        "--custom-loss-function-path",
    ),
    "teacher adapter without --teacher-load": (
        ["--teacher-lora-adapter-path", "/a"],
        "--teacher-lora-adapter-path requires --teacher-load",
    ),
    "--teacher-cpu-offload without --teacher-load": (
        ["--teacher-cpu-offload"],
        "--teacher-cpu-offload requires --teacher-load",
    ),
    "actor adapter without --use-lora": (
        ["--lora-adapter-path", "/a"],
        "--lora-adapter-path requires --use-lora",
    ),
    "actor adapters, one per component": (
        ["--use-lora", "--lora-adapter-path", "/a", "/b"],
        "--lora-adapter-path takes one value per component (--update-weight-target-module: 1), "
        "got 2",
    ),
    "reference adapters, one per component": (
        ["--ref-load", "/r", "--ref-lora-adapter-path", "/a,/b"],
        "--ref-lora-adapter-path takes one value per component (--update-weight-target-module: "
        "1), got 2",
    ),
    "teacher adapters, one per component": (
        ["--teacher-load", "/t", *HOOK, "--update-weight-target-module", "model"]
        + ["--teacher-lora-adapter-path", "/a", "/b"],
        "--teacher-lora-adapter-path takes one value per component "
        "(--update-weight-target-module: 1), got 2",
    ),
    "--rollout-weights ema without EMA": (
        ["--rollout-weights", "ema"],
        "--rollout-weights ema requires --use-ema",
    ),
    "--eval-weights ema without EMA": (
        ["--eval-weights", "ema"],
        "--eval-weights ema requires --use-ema",
    ),
    "--old-policy ema without EMA": (
        ["--old-policy", "ema"],
        "--old-policy ema requires --use-ema",
    ),
    "EMA without a consumer": (
        ["--use-ema"],
        "--use-ema has no consumer: add --rollout-weights ema, --eval-weights ema or "
        "--old-policy ema",
    ),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_role_argument_error(case):
    argv, message = ERRORS[case]
    with pytest.raises(ArgumentError) as err:
        parse(*argv)
    assert str(err.value) == message


def test_cli_prints_one_line_and_exits_2(capsys):
    argv, message = ERRORS["EMA without a consumer"]
    with pytest.raises(SystemExit) as exit_:
        parse_args_or_exit(argv, [*core_groups(), *fsdp_groups()])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(message)


@pytest.mark.parametrize(
    "argv",
    [
        ["--use-ema", "--rollout-weights", "ema"],
        ["--use-ema", "--eval-weights", "ema"],
        ["--use-ema", "--old-policy", "ema"],
        ["--teacher-load", "{t}", *HOOK],
        ["--teacher-load", "{t}", "--custom-loss-function-path", "hook_programs:distill_loss"],
        ["--use-lora", "--use-kl-loss"],
    ],
)
def test_valid_neighbours_parse(tmp_path, argv):
    """Each error's valid neighbour: one EMA consumer is enough, a teacher with either hook."""
    args = parse(*[a.format(t=tmp_path) for a in argv])
    assert args.ref_mode in ("none", "lora_base")
