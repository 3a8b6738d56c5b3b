"""Flags the launcher owns: placement, engines, rollout and output (``launch`` entry point).

``--colocate`` and ``--train-backend`` are miles-core's (shared placement group); the offload
tri-states are resolved by miles-core's offload group. ``--tensorboard-dir`` is miles-core's
(shared reporting group): the backends write under it too.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from miles_core.args import ArgGroup, ArgumentError, flag
from miles_core.args.checks import at_least, greater_than, option, requires, within

from miles_launch.batch_steps import resolve_steps_per_rollout
from miles_launch.debug_args import DebugDataArgs
from miles_launch.rollout_checks import check_stop_token_ids, partial_rollout, rollout_control

logger = logging.getLogger(__name__)

REWARD_TYPES = ("math", "label-char-fraction")


@dataclass
class LaunchPlacementArgs(ArgGroup):
    title: ClassVar[str] = "placement (launcher)"

    actor_num_nodes: int = flag(1, metavar="N", help="Nodes of the trainer.")
    actor_num_gpus_per_node: int = flag(
        1, metavar="N", help="Trainer ranks (GPUs, or CPU bundles without a GPU) per node."
    )
    rollout_num_gpus: int | None = flag(
        None,
        metavar="N",
        help="GPUs of all engines together (unset: one engine of --rollout-num-gpus-per-engine). "
        "Ignored under --colocate: the engines use the trainer's GPUs.",
    )
    rollout_num_gpus_per_engine: int = flag(
        1, metavar="N", help="GPUs per engine (SGLang --tp-size)."
    )
    num_gpus_per_node: int = flag(
        8, metavar="N", help="GPUs per node (set it on nodes with fewer than 8 usable GPUs)."
    )
    critic_num_nodes: int | None = flag(
        None,
        metavar="N",
        help="Nodes of the critic (--use-critic); the critic shares the trainer's ranks, so "
        "only --actor-num-nodes is accepted (unset: the same).",
    )
    critic_num_gpus_per_node: int | None = flag(
        None,
        metavar="N",
        help="Critic ranks per node (--use-critic); the critic shares the trainer's ranks, so "
        "only --actor-num-gpus-per-node is accepted (unset: the same).",
    )
    ray_address: str | None = flag(
        None,
        metavar="ADDR",
        help="Join this Ray cluster (e.g. 'auto' or 'ip:6379'); unset: start a local Ray sized "
        "to the job.",
    )

    @classmethod
    def validate(cls, args: Any) -> None:
        for dest in (
            "actor_num_nodes",
            "actor_num_gpus_per_node",
            "rollout_num_gpus_per_engine",
            "num_gpus_per_node",
        ):
            at_least(args, dest, 1)
        if not getattr(args, "load_debug_rollout_data", None):  # a replay starts no engines
            at_least(args, "rollout_num_gpus", 1)
        for critic, actor in (
            ("critic_num_nodes", "actor_num_nodes"),
            ("critic_num_gpus_per_node", "actor_num_gpus_per_node"),
        ):
            value = getattr(args, critic)
            if value is None:
                continue
            if not getattr(args, "use_critic", False):
                raise ArgumentError(f"{option(critic)} requires --use-critic")
            if value != getattr(args, actor):
                raise ArgumentError(
                    f"{option(critic)} {value}: the critic runs on the trainer's ranks, "
                    f"so it must equal {option(actor)} ({getattr(args, actor)})"
                )
        if args.actor_num_gpus_per_node > args.num_gpus_per_node:
            raise ArgumentError(
                f"--actor-num-gpus-per-node {args.actor_num_gpus_per_node} exceeds "
                f"--num-gpus-per-node {args.num_gpus_per_node}"
            )
        if args.rollout_num_gpus_per_engine > args.num_gpus_per_node:
            raise ArgumentError(
                f"--rollout-num-gpus-per-engine {args.rollout_num_gpus_per_engine} exceeds "
                f"--num-gpus-per-node {args.num_gpus_per_node} (an engine spans one node)"
            )
        if args.colocate:
            if args.actor_num_gpus_per_node % args.rollout_num_gpus_per_engine:
                raise ArgumentError(
                    f"--colocate: --rollout-num-gpus-per-engine {args.rollout_num_gpus_per_engine}"
                    f" does not divide --actor-num-gpus-per-node {args.actor_num_gpus_per_node}"
                    " (an engine spans one node)"
                )
        elif args.rollout_num_gpus is not None:
            if args.rollout_num_gpus % args.rollout_num_gpus_per_engine:
                raise ArgumentError(
                    f"--rollout-num-gpus {args.rollout_num_gpus} is not a multiple of "
                    f"--rollout-num-gpus-per-engine {args.rollout_num_gpus_per_engine}"
                )

    @classmethod
    def resolve_defaults(cls, args: Any) -> None:
        trainer = args.actor_num_nodes * args.actor_num_gpus_per_node
        if args.colocate:
            if args.rollout_num_gpus is not None and args.rollout_num_gpus != trainer:
                logger.warning(
                    "--colocate: --rollout-num-gpus %d ignored, reconciled to the %d trainer GPUs",
                    args.rollout_num_gpus,
                    trainer,
                )
            args.rollout_num_gpus = trainer
            for dest in ("offload_train", "offload_rollout"):
                if dest in args.explicit_flags and not getattr(args, dest):
                    logger.warning(
                        "--colocate with --no-%s: both sides keep their memory resident; "
                        "they may not fit together",
                        dest.replace("_", "-"),
                    )
        elif args.rollout_num_gpus is None:
            args.rollout_num_gpus = args.rollout_num_gpus_per_engine


@dataclass
class EngineLaunchArgs(ArgGroup):
    title: ClassVar[str] = "rollout engines"

    rollout_engine: Literal["sglang", "builtin"] | None = flag(
        None,
        help="Inference engine: SGLang (python -m sglang.launch_server) or the built-in "
        "transformers engine (unset: sglang when importable, else builtin).",
    )
    sglang_router_ip: str | None = flag(
        None, metavar="IP", help="External router address: engines register there (no own router)."
    )
    sglang_router_port: int | None = flag(None, metavar="PORT", help="External router port.")
    sglang_mem_fraction_static: float | None = flag(
        None,
        metavar="F",
        help="SGLang --mem-fraction-static (unset: 0.8 under --colocate, else SGLang's default).",
    )
    sglang_context_length: int | None = flag(
        None, metavar="N", help="SGLang --context-length: serve beyond config.json's max context."
    )
    sglang_api_key: str | None = flag(
        None,
        metavar="KEY",
        help="The one API key of the engines' control plane: passed to every engine and router "
        "miles starts and sent by every client (Authorization: Bearer). Unset while engines "
        "bind a non-loopback address: a key is generated for the job.",
    )
    engine_startup_timeout: float = flag(
        600.0, metavar="S", help="Seconds an engine (or the router) may take to become healthy."
    )

    @classmethod
    def validate(cls, args: Any) -> None:
        from miles_launch.engine_launch.sglang_flags import check_with_sglang
        from miles_launch.engine_launch.sglang_launcher import check_passthrough

        check_passthrough(args.sglang_passthrough)
        if args.rollout_engine != "builtin":
            check_with_sglang(args.sglang_passthrough)
        if (args.sglang_router_ip is None) != (args.sglang_router_port is None):
            raise ArgumentError("--sglang-router-ip and --sglang-router-port go together")
        within(args, "sglang_mem_fraction_static", 0.01, 1.0)
        at_least(args, "sglang_context_length", 1)
        if args.rollout_engine == "builtin" and args.rollout_num_gpus_per_engine > 1:
            raise ArgumentError(
                f"--rollout-num-gpus-per-engine {args.rollout_num_gpus_per_engine}: the built-in "
                "engine serves on one device; use --rollout-engine sglang"
            )

    @classmethod
    def resolve_defaults(cls, args: Any) -> None:
        if args.rollout_engine is None:
            args.rollout_engine = "sglang" if sglang_importable() else "builtin"
        if args.colocate and args.sglang_mem_fraction_static is None:
            args.sglang_mem_fraction_static = 0.8
        if args.colocate and args.rollout_engine == "sglang":
            args.sglang_passthrough.setdefault("cuda-graph-backend-prefill", "disabled")


def sglang_importable() -> bool:
    """Whether ``sglang`` can be imported here (checked without importing it)."""
    from importlib.util import find_spec

    return find_spec("sglang") is not None


@dataclass
class RolloutArgs(ArgGroup):
    title: ClassVar[str] = "rollout"

    prompt_data: str | None = flag(
        None,
        metavar="FILE",
        help="Prompt set: JSONL (one JSON object per line) or .parquet (one record per row).",
    )
    input_key: str = flag("prompt", help="Key of the prompt in each --prompt-data record.")
    label_key: str | None = flag("label", help="Key of the label (reward reference), if any.")
    metadata_key: str | None = flag(
        "metadata",
        help="Key of an optional object passed to the reward function as RewardInput.metadata.",
    )
    apply_chat_template: bool = flag(
        False, help="Wrap each prompt as a user message with the tokenizer's chat template."
    )
    rollout_shuffle: bool = flag(True, help="Shuffle the prompts each epoch (seeded by --seed).")
    num_rollout: int = flag(1, metavar="N", help="Rollouts (generate + train) to run in total.")
    rollout_batch_size: int = flag(8, metavar="N", help="Prompts per rollout.")
    n_samples_per_prompt: int = flag(4, metavar="N", help="Responses sampled per prompt (a group).")
    rollout_top_p: float = flag(1.0, help="Top-p of rollout sampling.")
    rollout_top_k: int = flag(-1, help="Top-k of rollout sampling (-1: all tokens).")
    rollout_max_response_len: int = flag(
        1024, metavar="N", help="Most tokens generated per response."
    )
    rm_type: Literal["math", "label-char-fraction"] | None = flag(
        None,
        help="Built-in reward: math (exact match of the final answer with the label) or "
        "label-char-fraction (share of the --rollout-max-response-len positions holding a "
        "character of the label; the demo's).",
    )
    custom_rm_path: str | None = flag(
        None,
        metavar="MODULE:FUNC",
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
        "unfinished samples continue in the next rollout, the carried tokens re-scored under "
        "the new weights.",
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
    eval_interval: int | None = flag(None, metavar="N", help="Evaluate every N rollouts.")
    eval_prompt_data: list[str] | None = flag(
        None,
        metavar="NAME PATH",
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
        help="Keep generating while the trainer steps (disaggregated only); weights are "
        "published every --update-weights-interval rollouts.",
    )
    update_weights_interval: int = flag(
        1, metavar="N", help="Publish weights to the engines every N rollouts (--fully-async)."
    )

    @classmethod
    def validate(cls, args: Any) -> None:
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
        if args.fully_async and getattr(args, "use_critic", False):
            raise ArgumentError(
                "--fully-async with --use-critic is not supported: PPO with a critic runs the "
                "synchronous loop"
            )
        if args.fully_async and args.colocate:
            raise ArgumentError(
                "--fully-async cannot be used with --colocate: generation and training "
                "must run on separate GPUs"
            )
        given = [f for f in ("rm_type", "custom_rm_path", "rm_url") if getattr(args, f)]
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
        if args.custom_rm_path and ":" not in args.custom_rm_path:
            raise ArgumentError(
                f"--custom-rm-path {args.custom_rm_path!r}: expected MODULE:FUNCTION"
            )
        requires(args, "eval_interval", "eval_prompt_data")
        requires(args, "skip_eval_before_train", "eval_prompt_data")
        requires(args, "dynamic_sampling_filter_path", "dynamic_filter")
        if not math.isfinite(args.pass_threshold):
            raise ArgumentError(
                f"--pass-threshold must be a finite number, got {args.pass_threshold}"
            )
        requires(args, "eval_prompt_data", "eval_interval")
        eval_weights = getattr(args, "eval_weights", "actor")
        if args.fully_async and eval_weights != getattr(args, "rollout_weights", "actor"):
            raise ArgumentError(
                f"--eval-weights {eval_weights} cannot be used with --fully-async: evaluation "
                "would publish other weights while training rollouts are being generated"
            )

    @classmethod
    def check_paths(cls, args: Any) -> None:
        from pathlib import Path

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
            from miles_core.user_functions import load_function

            load_function(args.dynamic_sampling_filter_path, "--dynamic-sampling-filter-path")
        if args.custom_generate_function_path:
            from miles_launch.rollout.custom_generate import load_generate_function

            load_generate_function(args.custom_generate_function_path)

    @classmethod
    def resolve_defaults(cls, args: Any) -> None:
        if args.rollout_seed is None:
            args.rollout_seed = args.seed
        resolve_steps_per_rollout(args)  # --global-batch-size -> --num-steps-per-rollout


def eval_sets(args: Any) -> dict[str, str]:
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


@dataclass
class OutputArgs(ArgGroup):
    title: ClassVar[str] = "output"

    metrics_jsonl: str | None = flag(
        None,
        metavar="PATH",
        help="Append one JSON object per rollout (metrics, timings, prompt ids, weight version).",
    )
    progress: bool = flag(
        True,
        help="Progress bars for generation and training on stderr, when stderr is a terminal "
        "(a log gets the per-rollout lines only).",
    )
    use_wandb: bool = flag(False, help="Log the per-rollout metrics to Weights & Biases.")
    wandb_project: str = flag("miles", help="W&B project.")
    wandb_run_name: str | None = flag(None, help="W&B run name.")


@dataclass
class JobArgs(ArgGroup):
    title: ClassVar[str] = "job (preflight and plan)"

    dry_run: bool = flag(
        False,
        help="Check the job (flags, files, this machine), print its plan and exit 0 without "
        "starting Ray, a trainer rank or an engine.",
    )
    load_required: bool = flag(
        False,
        help="Refuse to start when --load holds no checkpoint (without it the run starts "
        "fresh and says so).",
    )

    @classmethod
    def validate(cls, args: Any) -> None:
        requires(args, "load_required", "load")


def launch_groups() -> list[type[ArgGroup]]:
    """The ``miles.arg_groups`` entry point ``launch``."""
    return [
        LaunchPlacementArgs,
        EngineLaunchArgs,
        RolloutArgs,
        OutputArgs,
        DebugDataArgs,
        JobArgs,
    ]
