"""Flags the launcher owns: placement, engines, output and the job (``launch`` entry point); the
rollout flags are :mod:`miles_launch.rollout_args`.

``--colocate`` and ``--train-backend`` are miles-core's (shared placement group); the offload
tri-states are resolved by miles-core's offload group. ``--tensorboard-dir`` is miles-core's
(shared reporting group): the backends write under it too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib.util import find_spec
from typing import ClassVar, Literal

from miles_core.args import ArgGroup, ArgumentError, flag
from miles_core.args.checks import at_least, flag_value, option, requires, within
from miles_core.args.parsed import ParsedArgs

from miles_launch.debug_args import DebugDataArgs
from miles_launch.engine_launch.watch_timing import MIN_HEALTH_TIMEOUT_S
from miles_launch.placement import critic_ranks
from miles_launch.rollout_args import RolloutArgs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchPlacementArgs(ArgGroup):
    title: ClassVar[str] = "placement (launcher)"

    actor_num_nodes: int = flag(1, metavar="N", common=True, help="Nodes of the trainer.")
    actor_num_gpus_per_node: int = flag(
        1,
        metavar="N",
        common=True,
        help="Trainer ranks (GPUs, or CPU bundles without a GPU) per node.",
    )
    rollout_num_gpus: int | None = flag(
        None,
        metavar="N",
        common=True,
        help="GPUs of all engines together (unset: one engine of --rollout-num-gpus-per-engine). "
        "Ignored under --colocate: the engines use the trainer's GPUs.",
    )
    rollout_num_gpus_per_engine: int = flag(
        1, metavar="N", common=True, help="GPUs per engine (SGLang --tp-size)."
    )
    num_gpus_per_node: int = flag(
        8, metavar="N", help="GPUs per node (set it on nodes with fewer than 8 usable GPUs)."
    )
    critic_num_nodes: int | None = flag(
        None,
        metavar="N",
        help="Nodes of a critic on its own ranks (--use-critic). With this flag or "
        "--critic-num-gpus-per-node the critic gets GPUs, processes and a data-parallel world of "
        "its own and trains while the actor does (unset here: --actor-num-nodes); with neither "
        "it lives in the trainer's ranks. FSDP and the synchronous loop only.",
    )
    critic_num_gpus_per_node: int | None = flag(
        None,
        metavar="N",
        help="Ranks per node of a critic on its own ranks (--use-critic; see --critic-num-nodes; "
        "unset here: --actor-num-gpus-per-node).",
    )
    ray_address: str | None = flag(
        None,
        metavar="ADDR",
        help="Join this Ray cluster (e.g. 'auto' or 'ip:6379'); unset: start a local Ray sized "
        "to the job.",
    )

    @classmethod
    def validate(cls, args: ParsedArgs) -> None:
        for dest in (
            "actor_num_nodes",
            "actor_num_gpus_per_node",
            "rollout_num_gpus_per_engine",
            "num_gpus_per_node",
        ):
            at_least(args, dest, 1)
        if not args.load_debug_rollout_data:  # a replay starts no engines
            at_least(args, "rollout_num_gpus", 1)
        for dest, value in (
            ("critic_num_nodes", args.critic_num_nodes),
            ("critic_num_gpus_per_node", args.critic_num_gpus_per_node),
        ):
            if value is not None:
                requires(args, dest, "use_critic")
                at_least(args, dest, 1)
        if critic_ranks(args):
            check_critic_ranks(args)
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
    def resolve_defaults(cls, args: ParsedArgs) -> None:
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
                if dest in args.explicit_flags and not flag_value(args, dest):
                    logger.warning(
                        "--colocate with --no-%s: both sides keep their memory resident; "
                        "they may not fit together",
                        dest.replace("_", "-"),
                    )
        elif args.rollout_num_gpus is None:
            args.rollout_num_gpus = args.rollout_num_gpus_per_engine
        if critic_ranks(args):  # a critic on its own ranks: the unset one is the actor's
            if args.critic_num_nodes is None:
                args.critic_num_nodes = args.actor_num_nodes
            if args.critic_num_gpus_per_node is None:
                args.critic_num_gpus_per_node = args.actor_num_gpus_per_node


def sharded_replicas(args: ParsedArgs) -> int:
    """Replicas of the sharded model: FSDP's ``--dp-replicate-size`` where its group is parsed;
    1 without it (the launcher's groups parsed alone, or Megatron's, which has no replicas)."""
    return args.dp_replicate_size if "dp_replicate_size" in args else 1


def fsdp_cpu_offload(args: ParsedArgs) -> bool:
    """FSDP's ``--fsdp-cpu-offload`` where its group is parsed; False without it."""
    return "fsdp_cpu_offload" in args and args.fsdp_cpu_offload


def check_critic_ranks(args: ParsedArgs) -> None:
    """A critic on its own ranks: proven with FSDP's synchronous loop only; its nodes fit
    ``--num-gpus-per-node`` and its world divides into FSDP's ``--dp-replicate-size``."""
    ranks = critic_ranks(args)
    per_node = args.critic_num_gpus_per_node or args.actor_num_gpus_per_node
    # proven by tests/miles_launch/test_critic_own_ranks_e2e.py: FSDP, the synchronous loop
    unproven = (
        f"--train-backend {args.train_backend}" if args.train_backend != "fsdp" else None,
        "--fully-async" if args.fully_async else None,
    )
    for flag_given in unproven:
        if flag_given:
            raise ArgumentError(
                f"a critic on its own ranks (--critic-num-nodes / --critic-num-gpus-per-node) "
                f"with {flag_given} is not supported yet (proven: --train-backend fsdp, "
                "synchronous); leave both unset and the critic shares the trainer's ranks"
            )
    if per_node > args.num_gpus_per_node:
        raise ArgumentError(
            f"--critic-num-gpus-per-node {per_node} exceeds --num-gpus-per-node "
            f"{args.num_gpus_per_node}"
        )
    replicas = sharded_replicas(args)
    if ranks % replicas:
        raise ArgumentError(
            f"the critic's {ranks} rank(s) (--critic-num-nodes x --critic-num-gpus-per-node) "
            f"are not divisible by --dp-replicate-size {replicas}"
        )


@dataclass(frozen=True)
class EngineLaunchArgs(ArgGroup):
    title: ClassVar[str] = "rollout engines"

    rollout_engine: Literal["sglang", "builtin"] | None = flag(
        None,
        common=True,
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
        common=True,
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
    engine_restart_limit: int | None = flag(
        None,
        metavar="N",
        help="Engine restarts the run may make: an engine that dies or hangs is restarted on its "
        "placement, its requests go to the other engines, and it serves again once a publish "
        "gave it the current weights. 0: a dead engine ends the run. Unset: 2, or 0 under "
        "--colocate and --update-weight-transfer-mode disk-delta (where a restart is refused).",
    )
    engine_restart_backoff: float = flag(
        2.0,
        metavar="S",
        help="Seconds before an engine is restarted, doubled for each restart already made.",
    )
    engine_health_timeout: float = flag(
        60.0,
        metavar="S",
        help="During generation, an engine whose /health has not answered 200 for S seconds "
        "counts as hung: it is stopped and restarted (--engine-restart-limit). At least "
        f"{MIN_HEALTH_TIMEOUT_S:g}: the engines are watched once a second, and a shorter "
        "timeout would count a healthy engine whose answer is a moment late as hung.",
    )

    @classmethod
    def validate(cls, args: ParsedArgs) -> None:
        # miles_launch.engine_launch.sglang_flags is off the CLI's parse path
        from miles_launch.engine_launch.sglang_flags import check_with_sglang

        # miles_launch.engine_launch.sglang_launcher is off the CLI's parse path
        from miles_launch.engine_launch.sglang_launcher import check_passthrough

        check_passthrough(args.sglang_passthrough)
        if args.rollout_engine != "builtin":
            check_with_sglang(args.sglang_passthrough)
        if (args.sglang_router_ip is None) != (args.sglang_router_port is None):
            raise ArgumentError("--sglang-router-ip and --sglang-router-port go together")
        within(args, "sglang_mem_fraction_static", 0.01, 1.0)
        at_least(args, "sglang_context_length", 1)
        at_least(args, "engine_restart_limit", 0)
        at_least(args, "engine_restart_backoff", 0.0)
        if not args.engine_health_timeout >= MIN_HEALTH_TIMEOUT_S:  # NaN too
            raise ArgumentError(
                f"--engine-health-timeout must be >= {MIN_HEALTH_TIMEOUT_S:g} (the engines' "
                f"/health is watched once a second), got {args.engine_health_timeout:g}"
            )
        if args.engine_restart_limit:
            for reason in restart_refusals(args):
                raise ArgumentError(f"--engine-restart-limit {args.engine_restart_limit}: {reason}")
        else:  # no engine is watched or restarted: these would do nothing
            for dest in ("engine_restart_backoff", "engine_health_timeout"):
                if dest in args.explicit_flags:
                    raise ArgumentError(
                        f"{option(dest)} acts on engine restarts, and this job makes none "
                        "(--engine-restart-limit 0)"
                    )
        if args.rollout_engine == "builtin" and args.rollout_num_gpus_per_engine > 1:
            raise ArgumentError(
                f"--rollout-num-gpus-per-engine {args.rollout_num_gpus_per_engine}: the built-in "
                "engine serves on one device; use --rollout-engine sglang"
            )

    @classmethod
    def resolve_defaults(cls, args: ParsedArgs) -> None:
        if args.engine_restart_limit is None:
            args.engine_restart_limit = 0 if restart_refusals(args) else DEFAULT_RESTART_LIMIT
        if args.rollout_engine is None:
            args.rollout_engine = "sglang" if sglang_importable() else "builtin"
        if args.colocate and args.sglang_mem_fraction_static is None:
            args.sglang_mem_fraction_static = 0.8
        if args.colocate and args.rollout_engine == "sglang":
            args.sglang_passthrough.setdefault("cuda-graph-backend-prefill", "disabled")


#: ``--engine-restart-limit`` where restarts are possible and the flag is unset
DEFAULT_RESTART_LIMIT = 2


def restart_refusals(args: ParsedArgs) -> list[str]:
    """Why this job's engines cannot be restarted ([] when they can): colocated engines share
    the trainer's memory cycle, and a disk-delta puller's chain belongs to its engine."""
    reasons = []
    if args.colocate:
        reasons.append("engines are not restarted under --colocate (set it to 0)")
    if args.update_weight_transfer_mode == "disk-delta":
        reasons.append(
            "engines are not restarted under --update-weight-transfer-mode disk-delta (set it to 0)"
        )
    return reasons


def sglang_importable() -> bool:
    """Whether ``sglang`` can be imported here (checked without importing it)."""

    return find_spec("sglang") is not None


@dataclass(frozen=True)
class OutputArgs(ArgGroup):
    title: ClassVar[str] = "output"

    metrics_jsonl: str | None = flag(
        None,
        metavar="PATH",
        common=True,
        help="Append one JSON object per rollout (metrics, timings, prompt ids, weight version).",
    )
    progress: bool = flag(
        True,
        help="Progress bars for generation and training on stderr, when stderr is a terminal "
        "(a log gets the per-rollout lines only).",
    )
    use_wandb: bool = flag(
        False, common=True, help="Log the per-rollout metrics to Weights & Biases."
    )
    wandb_project: str = flag("miles", help="W&B project.")
    wandb_run_name: str | None = flag(None, help="W&B run name.")


#: The backends the memory plan (:mod:`miles_launch.memory_plan`) estimates.
MEMORY_PLAN_BACKENDS = ("fsdp", "megatron")


@dataclass(frozen=True)
class JobArgs(ArgGroup):
    title: ClassVar[str] = "job (preflight and plan)"

    dry_run: bool = flag(
        False,
        common=True,
        help="Check the job (flags, files, this machine), print its plan and exit 0 without "
        "starting Ray, a trainer rank or an engine.",
    )
    load_required: bool = flag(
        False,
        help="Refuse to start when --load holds no checkpoint (without it the run starts "
        "fresh and says so).",
    )

    gpu_memory_gib: float | None = flag(
        None,
        metavar="GIB",
        help="Memory of one trainer GPU, in GiB, that the plan's memory estimate is checked "
        "against (unset: the local CUDA device's; a driver without one, e.g. a cluster head "
        "with --ray-address, prints the estimate unchecked).",
    )
    ignore_memory_plan: bool = flag(
        False,
        help="Start even when the plan's memory estimate per trainer GPU exceeds the GPU's "
        "memory (docs/miles-launch.md says what the estimate counts).",
    )

    @classmethod
    def validate(cls, args: ParsedArgs) -> None:
        requires(args, "load_required", "load")
        if args.gpu_memory_gib is not None and args.gpu_memory_gib <= 0:
            raise ArgumentError(f"--gpu-memory-gib must be > 0, got {args.gpu_memory_gib}")
        if args.train_backend not in MEMORY_PLAN_BACKENDS:
            given = {
                "gpu_memory_gib": args.gpu_memory_gib is not None,
                "ignore_memory_plan": args.ignore_memory_plan,
            }
            for dest in (dest for dest, on in given.items() if on):
                raise ArgumentError(
                    f"{option(dest)}: the memory plan estimates --train-backend "
                    f"{' and '.join(MEMORY_PLAN_BACKENDS)}, not {args.train_backend}"
                )


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
