"""The rollout flags (``launch`` entry point): prompts, sampling, rewards, evaluation and
dynamic sampling, with their checks (:mod:`miles_launch.rollout_checks`)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from miles_core.args import ArgGroup, ArgumentError, flag
from miles_core.args.checks import at_least, flag_value, greater_than, requires
from miles_core.args.parsed import ParsedArgs
from miles_core.user_functions import load_function

from miles_launch.batch_steps import resolve_steps_per_rollout
from miles_launch.rollout_checks import check_stop_token_ids, partial_rollout, rollout_control

logger = logging.getLogger(__name__)

REWARD_TYPES = ("math", "label-char-fraction")


@dataclass(frozen=True)
class RolloutArgs(ArgGroup):
    title: ClassVar[str] = "rollout"

    prompt_data: str | None = flag(
        None,
        metavar="FILE",
        common=True,
        help="Prompt set: JSONL (one JSON object per line) or .parquet (one record per row).",
    )
    input_key: str = flag(
        "prompt", common=True, help="Key of the prompt in each --prompt-data record."
    )
    label_key: str | None = flag(
        "label", common=True, help="Key of the label (reward reference), if any."
    )
    metadata_key: str | None = flag(
        "metadata",
        help="Key of an optional object passed to the reward function as RewardInput.metadata.",
    )
    apply_chat_template: bool = flag(
        False,
        common=True,
        help="Wrap each prompt as a user message with the tokenizer's chat template.",
    )
    rollout_shuffle: bool = flag(True, help="Shuffle the prompts each epoch (seeded by --seed).")
    num_rollout: int = flag(
        1, metavar="N", common=True, help="Rollouts (generate + train) to run in total."
    )
    rollout_batch_size: int = flag(8, metavar="N", common=True, help="Prompts per rollout.")
    n_samples_per_prompt: int = flag(
        4, metavar="N", common=True, help="Responses sampled per prompt (a group)."
    )
    rollout_top_p: float = flag(1.0, help="Top-p of rollout sampling.")
    rollout_top_k: int = flag(-1, help="Top-k of rollout sampling (-1: all tokens).")
    rollout_max_response_len: int = flag(
        1024, metavar="N", common=True, help="Most tokens generated per response."
    )
    rm_type: Literal["math", "label-char-fraction"] | None = flag(
        None,
        common=True,
        help="Built-in reward: math (exact match of the final answer with the label) or "
        "label-char-fraction (share of the --rollout-max-response-len positions holding a "
        "character of the label; the demo's).",
    )
    custom_rm_path: str | None = flag(
        None,
        metavar="MODULE:FUNC",
        common=True,
        help="Reward function f(RewardInput) -> float or dict (sync or async); replaces --rm-type.",
    )
    custom_rm_batch: Literal["sample", "group", "rollout"] = flag(
        "sample",
        help="How --custom-rm-path is called: per sample, or with the list of a prompt group's "
        "(group) or a generation batch's (rollout) inputs, returning one value per input.",
    )
    rm_url: str | None = flag(
        None,
        metavar="URL",
        help="Remote reward server: one JSON POST per sample, the reply a number or an object "
        "(see --reward-key); replaces --rm-type.",
    )
    rm_timeout: float = flag(
        60.0, metavar="SECONDS", help="Timeout of one --rm-url request (then it is retried)."
    )
    rm_max_retries: int = flag(
        3,
        metavar="N",
        help="Retries of a --rm-url request that timed out, could not connect or got 429/5xx "
        "(backoff 0.5 s, doubling).",
    )
    reward_key: str | None = flag(
        None, metavar="KEY", help="Field of a dict reward (custom function or --rm-url reply)."
    )
    dynamic_filter: bool = flag(
        False,
        help="Drop prompt groups whose rewards are all equal (no learning signal) and draw "
        "more prompts until the rollout is full.",
    )
    dynamic_sampling_filter_path: str | None = flag(
        None,
        metavar="MODULE:FUNC",
        help="Under --dynamic-filter: keep a finished prompt group when FUNC(args, group) "
        "returns True (in place of 'its rewards are not all equal').",
    )
    dynamic_filter_max_draws: int = flag(
        4, metavar="N", help="Most prompt batches drawn per rollout under --dynamic-filter."
    )
    over_sampling_batch_size: int | None = flag(
        None,
        metavar="N",
        help="Under --dynamic-filter: generate N prompt groups per draw (N >= "
        "--rollout-batch-size) and keep the first that pass; --fully-async keeps N in flight.",
    )
    partial_rollout: bool = flag(
        False,
        help="Under --over-sampling-batch-size: once enough groups passed, abort the rest; their "
        "unfinished samples continue in the next rollout, the carried tokens keeping the "
        "log-probs they were sampled with.",
    )
    mask_offpolicy_in_partial_rollout: bool = flag(
        False,
        help="--partial-rollout: a continued sample's carried tokens (sampled by an older "
        "policy) get loss mask 0; only its continuation trains.",
    )
    custom_generate_function_path: str | None = flag(
        None,
        metavar="MODULE:FUNC",
        help="Async generate function f(ctx, prompt, sampling_params) -> CustomSample or a list "
        "(multi-turn, tools): it drives the engine itself and returns tokens, log-probs, "
        "loss_mask and optionally the reward (MODULE.FUNC also accepted).",
    )
    rollout_stop: list[str] | None = flag(
        None, metavar="STR", help="Stop strings of rollout sampling (SGLang sampling_params.stop)."
    )
    rollout_stop_token_ids: list[int] | None = flag(
        None, metavar="ID", help="Token ids that end a rollout response (besides EOS)."
    )
    rollout_max_prompt_len: int | None = flag(
        None,
        metavar="N",
        help="Drop training prompts longer than N tokens when loading (counted in the log and "
        "in every metrics record as prompts_too_long).",
    )
    rollout_seed: int | None = flag(
        None,
        metavar="N",
        help="Seed of rollout sampling (per-sample sampling_seed) and of the prompt shuffle "
        "(unset: --seed).",
    )
    eval_interval: int | None = flag(
        None, metavar="N", common=True, help="Evaluate every N rollouts."
    )
    eval_prompt_data: list[str] | None = flag(
        None,
        metavar="NAME PATH",
        common=True,
        help="Named evaluation sets, NAME PATH [NAME PATH ...] (files as --prompt-data).",
    )
    n_samples_per_eval_prompt: int = flag(
        1, metavar="N", help="Responses per eval prompt (pass@k for k up to N)."
    )
    eval_temperature: float | None = flag(
        None, help="Sampling temperature of evaluation (0: greedy; unset: --rollout-temperature)."
    )
    eval_top_p: float | None = flag(None, help="Top-p of evaluation (unset: --rollout-top-p).")
    eval_max_response_len: int | None = flag(
        None,
        metavar="N",
        help="Most tokens per evaluation response (unset: --rollout-max-response-len).",
    )
    skip_eval_before_train: bool = flag(
        False,
        help="Do not evaluate before the first rollout (by default a run that starts at "
        "rollout 0 with --eval-prompt-data evaluates the initial weights first).",
    )
    pass_threshold: float = flag(
        1.0,
        metavar="F",
        help="A sample passes (pass@k of eval sets and training rollouts) when its reward is at "
        "least F. The default 1.0 is the maximum of the built-in rewards; for a custom or "
        "remote reward set your task's pass criterion.",
    )
    fully_async: bool = flag(
        False,
        common=True,
        help="Keep generating while the trainer steps (disaggregated only); weights are "
        "published every --update-weights-interval rollouts.",
    )
    update_weights_interval: int = flag(
        1, metavar="N", help="Publish weights to the engines every N rollouts (--fully-async)."
    )
    max_weight_staleness: int | None = flag(
        None,
        metavar="N",
        help="--fully-async: a group with a sample generated with weights more than N versions "
        "older than the engines' at training time is dropped, not trained on (counted in "
        "stale_groups_dropped; 0: on-policy only); unset: no bound.",
    )

    @classmethod
    def validate(cls, args: ParsedArgs) -> None:
        for dest in (
            "num_rollout",
            "rollout_batch_size",
            "n_samples_per_prompt",
            "rollout_max_response_len",
            "dynamic_filter_max_draws",
            "n_samples_per_eval_prompt",
            "update_weights_interval",
            "eval_max_response_len",
            "rollout_max_prompt_len",
        ):
            at_least(args, dest, 1)
        rollout_control(args)
        partial_rollout(args)
        at_least(args, "eval_temperature", 0.0)
        if args.eval_top_p is not None and not 0.0 < args.eval_top_p <= 1.0:
            raise ArgumentError(f"--eval-top-p must be in (0, 1], got {args.eval_top_p}")
        eval_sets(args)  # NAME PATH pairs, names unique
        at_least(args, "eval_interval", 1)
        if not 0.0 < args.rollout_top_p <= 1.0:
            raise ArgumentError(f"--rollout-top-p must be in (0, 1], got {args.rollout_top_p}")
        if args.max_weight_staleness is not None:
            if not args.fully_async:
                raise ArgumentError(
                    "--max-weight-staleness bounds --fully-async's samples (the synchronous loop "
                    "trains on-policy); add --fully-async"
                )
            at_least(args, "max_weight_staleness", 0)
        if args.fully_async and args.colocate:
            raise ArgumentError(
                "--fully-async cannot be used with --colocate: generation and training "
                "must run on separate GPUs"
            )
        given = [f for f in ("rm_type", "custom_rm_path", "rm_url") if flag_value(args, f)]
        if len(given) > 1:
            names = " and ".join("--" + f.replace("_", "-") for f in given)
            raise ArgumentError(f"{names} are mutually exclusive")
        if args.rm_url and not args.rm_url.startswith(("http://", "https://")):
            raise ArgumentError(f"--rm-url {args.rm_url!r}: expected an http:// or https:// URL")
        greater_than(args, "rm_timeout", 0)
        at_least(args, "rm_max_retries", 0)
        if args.custom_rm_batch != "sample" and not args.custom_rm_path:
            raise ArgumentError(
                f"--custom-rm-batch {args.custom_rm_batch} requires --custom-rm-path"
            )
        if args.custom_rm_batch == "rollout" and args.fully_async:
            raise ArgumentError(
                "--custom-rm-batch rollout cannot be used with --fully-async: groups are "
                "trained as they finish; use --custom-rm-batch group"
            )
        requires(args, "eval_interval", "eval_prompt_data")
        requires(args, "skip_eval_before_train", "eval_prompt_data")
        requires(args, "dynamic_sampling_filter_path", "dynamic_filter")
        if not math.isfinite(args.pass_threshold):
            raise ArgumentError(
                f"--pass-threshold must be a finite number, got {args.pass_threshold}"
            )
        requires(args, "eval_prompt_data", "eval_interval")
        eval_weights = args.eval_weights
        if args.fully_async and eval_weights != args.rollout_weights:
            raise ArgumentError(
                f"--eval-weights {eval_weights} cannot be used with --fully-async: evaluation "
                "would publish other weights while training rollouts are being generated"
            )

    @classmethod
    def check_paths(cls, args: ParsedArgs) -> None:

        # miles_launch.rollout.routed_experts is off the CLI's parse path
        from miles_launch.rollout.routed_experts import read_layout, routing_replay_on

        if args.prompt_data is None:
            if args.load_debug_rollout_data:  # a replay draws no prompts
                return
            raise ArgumentError("--prompt-data is required (a JSONL or Parquet file of prompts)")
        if not Path(args.prompt_data).is_file():
            raise ArgumentError(f"--prompt-data {args.prompt_data}: no such file")
        for name, path in eval_sets(args).items():
            if not Path(path).is_file():
                raise ArgumentError(f"--eval-prompt-data {name} {path}: no such file")
        if routing_replay_on(args) and args.hf_checkpoint is not None:  # a MoE config
            read_layout(str(args.hf_checkpoint))
        check_stop_token_ids(args)
        if args.dynamic_sampling_filter_path:
            load_function(args.dynamic_sampling_filter_path, "--dynamic-sampling-filter-path")
        if args.custom_generate_function_path:
            # miles_launch.rollout.custom_generate is off the CLI's parse path
            from miles_launch.rollout.custom_generate import load_generate_function

            load_generate_function(args.custom_generate_function_path)

    @classmethod
    def resolve_defaults(cls, args: ParsedArgs) -> None:
        if args.rollout_seed is None:
            args.rollout_seed = args.seed
        resolve_steps_per_rollout(args)  # --global-batch-size -> --num-steps-per-rollout


def eval_sets(args: ParsedArgs) -> dict[str, str]:
    """``--eval-prompt-data NAME PATH ...`` as ``{name: path}`` (in the order given)."""
    values = args.eval_prompt_data or []
    if len(values) % 2:
        raise ArgumentError(
            f"--eval-prompt-data expects NAME PATH pairs, got {len(values)} values: "
            + " ".join(values)
        )
    sets: dict[str, str] = {}
    for name, path in zip(values[::2], values[1::2], strict=True):
        if name in sets:
            raise ArgumentError(f"--eval-prompt-data: the set name {name!r} is given twice")
        sets[name] = path
    return sets
