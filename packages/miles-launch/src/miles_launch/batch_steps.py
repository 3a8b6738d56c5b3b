"""``--global-batch-size`` resolved into ``--num-steps-per-rollout``, the one value the backends
read.

``--global-batch-size`` is the number of samples per optimizer step. The samples one rollout
trains are ``--rollout-batch-size x --n-samples-per-prompt`` (``--over-sampling-batch-size``
only changes how many groups are generated per draw under ``--dynamic-filter``, not how many
are kept), so ``num_steps_per_rollout = rollout_batch_size * n_samples_per_prompt /
global_batch_size``. A rollout that ``--dynamic-filter`` leaves short (its draws ran out) still
takes that many steps, each over a proportionally smaller slice.
"""

from __future__ import annotations

from miles_core.args import ArgumentError
from miles_core.args.checks import at_least
from miles_core.args.parsed import ParsedArgs


def samples_per_rollout(args: ParsedArgs) -> int:
    """Samples one rollout trains: ``--rollout-batch-size x --n-samples-per-prompt``."""
    return args.rollout_batch_size * args.n_samples_per_prompt


def resolve_steps_per_rollout(args: ParsedArgs) -> None:
    """With ``--global-batch-size`` set: ``args.num_steps_per_rollout`` becomes the samples per
    rollout divided by it; a remainder, or an explicit ``--num-steps-per-rollout`` that
    disagrees, is an argument error naming both flags."""
    size = args.global_batch_size
    if size is None:
        return
    for dest in ("global_batch_size", "rollout_batch_size", "n_samples_per_prompt"):
        at_least(args, dest, 1)
    samples = samples_per_rollout(args)
    per_rollout = (
        f"the {samples} samples per rollout (--rollout-batch-size {args.rollout_batch_size} x "
        f"--n-samples-per-prompt {args.n_samples_per_prompt})"
    )
    if samples % size:
        raise ArgumentError(
            f"--global-batch-size {size} does not divide {per_rollout}: no whole number of "
            "optimizer steps per rollout; give a divisor, or --num-steps-per-rollout instead"
        )
    steps = samples // size
    explicit = args.explicit_flags
    if "num_steps_per_rollout" in explicit and args.num_steps_per_rollout != steps:
        raise ArgumentError(
            f"--global-batch-size {size} and --num-steps-per-rollout "
            f"{args.num_steps_per_rollout} disagree: {per_rollout} make {steps} steps of "
            f"{size}; give one of the two"
        )
    args.num_steps_per_rollout = steps
