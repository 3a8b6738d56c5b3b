"""``--global-batch-size`` (samples per optimizer step) becomes ``--num-steps-per-rollout`` at
argument time, through the launcher's real parser."""

from __future__ import annotations

import pytest
from launch_testing import one_error_line, parse, run_cli
from miles_core import backends
from miles_core.args import ArgumentError

ROLLOUT = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "8"]  # 32 samples


@pytest.mark.parametrize(
    "flags, steps",
    [
        ([], 1),  # neither: one step
        (["--global-batch-size", "8"], 4),
        (["--global-batch-size", "32"], 1),
        (["--global-batch-size", "16", "--num-steps-per-rollout", "2"], 2),  # both, agreeing
        (["--num-steps-per-rollout", "3"], 3),  # only steps: as given (uneven slices allowed)
        # over-sampling generates more per draw; the rollout still trains 4 x 8 samples
        (["--dynamic-filter", "--over-sampling-batch-size", "12", "--global-batch-size", "8"], 4),
    ],
)
def test_steps_per_rollout(tmp_path, flags, steps):
    args = parse(tmp_path, *ROLLOUT, *flags)
    assert args.num_steps_per_rollout == steps


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--global-batch-size", "16", "--num-steps-per-rollout", "4"],
            "--global-batch-size 16 and --num-steps-per-rollout 4 disagree: the 32 samples per "
            "rollout (--rollout-batch-size 4 x --n-samples-per-prompt 8) make 2 steps of 16; "
            "give one of the two",
        ),
        (  # the default value, given explicitly, is still a disagreement
            ["--global-batch-size", "8", "--num-steps-per-rollout", "1"],
            "--global-batch-size 8 and --num-steps-per-rollout 1 disagree",
        ),
        (
            ["--global-batch-size", "12"],
            "--global-batch-size 12 does not divide the 32 samples per rollout "
            "(--rollout-batch-size 4 x --n-samples-per-prompt 8): no whole number of optimizer "
            "steps per rollout; give a divisor, or --num-steps-per-rollout instead",
        ),
        (["--global-batch-size", "64"], "--global-batch-size 64 does not divide the 32 samples"),
        (["--global-batch-size", "0"], "--global-batch-size must be >= 1, got 0"),
    ],
)
def test_inconsistent_sizes_are_refused(tmp_path, flags, message):
    with pytest.raises(ArgumentError) as error:
        parse(tmp_path, *ROLLOUT, *flags)
    assert str(error.value).startswith(message)


def test_cli_disagreement_is_one_line_exit_2():
    if "fsdp" not in backends.available():
        pytest.skip("the FSDP backend is not installed")
    sizes = ["--global-batch-size", "8", "--num-steps-per-rollout", "2"]
    line = one_error_line(run_cli("train", "--train-backend", "fsdp", *ROLLOUT, *sizes))
    assert "--global-batch-size 8 and --num-steps-per-rollout 2 disagree" in line
