"""The rollout-control flags' cross-checks (``--over-sampling-batch-size``, ``--rollout-stop*``,
``--rollout-max-prompt-len``, ``--rollout-seed``, ``--custom-generate-function-path``,
``--partial-rollout``), run by
:class:`miles_launch.rollout_args.RolloutArgs`."""

from __future__ import annotations

import json
from pathlib import Path

from miles_core.args import ArgumentError
from miles_core.args.checks import at_least
from miles_core.args.parsed import ParsedArgs


def rollout_control(args: ParsedArgs) -> None:
    """The rollout-control flags, each against the others (custom generation, over-sampling,
    stops, prompt length, seed)."""
    # miles_launch.rollout.routed_experts is off the CLI's parse path
    from miles_launch.rollout.routed_experts import routing_replay_on

    n = args.over_sampling_batch_size
    if n is not None:
        if not args.dynamic_filter:
            raise ArgumentError(
                "--over-sampling-batch-size requires --dynamic-filter (without a filter every "
                "group is kept: nothing to over-sample for)"
            )
        if n < args.rollout_batch_size:
            raise ArgumentError(
                f"--over-sampling-batch-size {n} is smaller than --rollout-batch-size "
                f"{args.rollout_batch_size}"
            )
    for token in args.rollout_stop_token_ids or []:
        if token < 0:
            raise ArgumentError(f"--rollout-stop-token-ids: {token} is not a token id")
    at_least(args, "rollout_seed", 0)
    if args.custom_generate_function_path is not None:  # its form: miles_core.user_functions
        if routing_replay_on(args):
            raise ArgumentError(
                "--custom-generate-function-path cannot be used with "
                "--use-rollout-routing-replay: a custom function's multi-turn samples carry "
                "no routed experts"
            )


def partial_rollout(args: ParsedArgs) -> None:
    """``--partial-rollout`` against the others: it needs a draw that leaves groups running
    (over-sampling), and refuses what would make a continued sample's record inconsistent."""
    # miles_launch.rollout.routed_experts is off the CLI's parse path
    from miles_launch.rollout.routed_experts import routing_replay_on

    if not args.partial_rollout:
        if args.mask_offpolicy_in_partial_rollout:
            raise ArgumentError(
                "--mask-offpolicy-in-partial-rollout masks the tokens --partial-rollout "
                "carries, which is off (add --partial-rollout)"
            )
        return
    refused = [
        (
            args.over_sampling_batch_size is None,
            "requires --over-sampling-batch-size (with --dynamic-filter): without over-sampling "
            "every drawn group is waited for and no sample is left unfinished",
        ),
        (
            args.fully_async,
            "cannot be used with --fully-async: its producer trains groups as they finish and "
            "aborts nothing",
        ),
        (
            args.custom_generate_function_path is not None,
            "cannot be used with --custom-generate-function-path: a custom function's turns "
            "cannot be cut short and continued",
        ),
        (
            routing_replay_on(args),
            "cannot be used with --use-rollout-routing-replay: a continued sample carries no "
            "routed experts for its carried tokens",
        ),
        (
            args.custom_rm_batch == "rollout",
            "cannot be used with --custom-rm-batch rollout: a group must be scored as it "
            "finishes to know when enough passed",
        ),
        (
            bool(args.rollout_stop),
            "cannot be used with --rollout-stop: a stop string spanning the carried tokens and "
            "the continuation would not be seen (--rollout-stop-token-ids can)",
        ),
        (
            bool(args.load_debug_rollout_data),
            "cannot be used with --load-debug-rollout-data: a replay generates nothing",
        ),
    ]
    for bad, why in refused:
        if bad:
            raise ArgumentError(f"--partial-rollout {why}")


def check_stop_token_ids(args: ParsedArgs) -> None:
    """``--rollout-stop-token-ids`` within the vocabulary of ``--hf-checkpoint``'s config.json
    (when it has one)."""

    if not args.rollout_stop_token_ids or args.hf_checkpoint is None:
        return
    config = Path(args.hf_checkpoint) / "config.json"
    if not config.is_file():
        return
    vocab = json.loads(config.read_text()).get("vocab_size")
    if not isinstance(vocab, int):
        return
    for token in args.rollout_stop_token_ids:
        if token >= vocab:
            raise ArgumentError(
                f"--rollout-stop-token-ids: {token} is outside the vocabulary of "
                f"--hf-checkpoint ({vocab} tokens)"
            )
