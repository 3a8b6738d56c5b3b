"""What a job will run where, as the lines ``miles train`` prints first (and ``--dry-run`` prints
alone, before exiting 0 without starting Ray)::

    plan: --train-backend fsdp, CPU (no CUDA device: every "GPU" below is a CPU slot)
      trainer: 2 ranks on 1 node (2 per node); FSDP data parallel 2 (2 shards x 1 replica)
      engines: 1 builtin engine x 1 GPU, disaggregated (their own bundles)
      weights: broadcast to the engines after every rollout
      offload: none (trainer and engines keep their memory)
      memory: trainer GPU ~1.3 MiB at peak (training), not checked (no local GPU, no ...); ...
      memory: engine GPU: built-in engine, weights 154.8 KiB plus a KV cache that grows ...
      memory: host per trainer node: no trainer state (nothing offloaded to it)
      rollouts: 12 x 8 prompts x 8 samples, responses up to 8 tokens, reward --rm-type ...
      checkpoints: none (no --save)
      outputs: metrics demo_output/metrics.jsonl; engine logs demo_output/logs

Pure arithmetic over the parsed flags (and the preflight's notes): nothing is started. The
``memory:`` lines are :mod:`miles_launch.memory_plan`'s.
"""

from __future__ import annotations

import os

from miles_core.args.parsed import ParsedArgs

from miles_launch.args import fsdp_cpu_offload, sharded_replicas
from miles_launch.memory_plan import plan_memory_lines
from miles_launch.placement import Layout, nodes_needed, plan_layout


def run_dir(args: ParsedArgs) -> str | None:
    """The run's output directory: that of ``--metrics-jsonl`` (where ``miles plot`` looks),
    else ``--save``; None when the run names neither."""
    if args.metrics_jsonl:
        return os.path.dirname(os.path.abspath(args.metrics_jsonl))
    return os.path.abspath(args.save) if args.save else None


def log_dir(args: ParsedArgs) -> str | None:
    """Where the engines' (and the router's, the pullers') logs go: ``<run dir>/logs``."""
    base = run_dir(args)
    return os.path.join(base, "logs") if base else None


def trainer_line(args: ParsedArgs, layout: Layout) -> str:
    ranks = layout.num_trainer_ranks
    nodes = args.actor_num_nodes
    where = f"{ranks} rank(s) on {nodes} node(s) ({args.actor_num_gpus_per_node} per node)"
    if args.train_backend == "megatron":
        sizes = {
            "TP": args.tensor_model_parallel_size,
            "PP": args.pipeline_model_parallel_size,
            "CP": args.context_parallel_size,
        }
        model = sizes["TP"] * sizes["PP"] * sizes["CP"]
        parts = [f"{k} {v}" for k, v in sizes.items()] + [f"DP {ranks // model}"]
        ep = args.expert_model_parallel_size
        if ep > 1:
            parts.append(f"EP {ep}")
        return f"trainer: {where}; Megatron {' x '.join(parts)}"
    if args.train_backend == "fsdp":
        replicas = sharded_replicas(args)
        return (
            f"trainer: {where}; FSDP data parallel {ranks} ({ranks // replicas} shards x "
            f"{replicas} replica(s))"
        )
    return f"trainer: {where}; --train-backend {args.train_backend}"


def critic_line(args: ParsedArgs, layout: Layout) -> str | None:
    """A critic on its own ranks (None for one in the trainer's ranks, or none)."""
    if not layout.num_critic_ranks:
        return None
    return (
        f"critic: its own {layout.num_critic_ranks} rank(s) on {args.critic_num_nodes} node(s) "
        f"({args.critic_num_gpus_per_node} per node), data parallel over them; it trains while "
        "the actor does"
    )


def engines_line(args: ParsedArgs, layout: Layout) -> str:
    if args.load_debug_rollout_data:
        return f"engines: none (a replay of {args.load_debug_rollout_data})"
    unit = "GPU" if layout.use_gpu else "CPU slot"
    where = (
        "colocated (on the trainer's GPUs, taking turns)"
        if layout.colocate
        else "disaggregated (their own bundles)"
    )
    line = (
        f"engines: {layout.num_engines} {args.rollout_engine} engine(s) x "
        f"{layout.gpus_per_engine} {unit}, {where}"
    )
    if args.sglang_router_ip:
        line += f"; external router {args.sglang_router_ip}:{args.sglang_router_port}"
    return line


def weights_line(args: ParsedArgs) -> str:
    if args.load_debug_rollout_data:
        return "weights: not published (no engines)"
    mode = args.update_weight_transfer_mode
    every = (
        f"every {args.update_weights_interval} rollouts (--fully-async)"
        if args.fully_async
        else "after every rollout"
    )
    where = f" through {args.update_weight_disk_dir}" if mode == "disk-delta" else ""
    return f"weights: {mode}{where} to the engines {every}"


def offload_line(args: ParsedArgs) -> str:
    parts = []
    if args.offload_train:
        target = args.offload_train_target
        if target == "disk":
            target = f"disk ({args.offload_train_disk_dir or 'under the temp dir'})"
        parts.append(f"the trainer sleeps to {target} during generation")
    if args.offload_rollout:
        parts.append("the engines release their memory during training")
    if args.stream_optimizer_state_to_disk:
        parts.append("optimizer state streamed from disk")
    if args.optimizer_cpu_offload or fsdp_cpu_offload(args):
        parts.append("optimizer step on the CPU")
    return "offload: " + (
        "; ".join(parts) if parts else "none (trainer and engines keep their memory)"
    )


def rollouts_line(args: ParsedArgs) -> str:
    reward = (
        f"--rm-type {args.rm_type}"
        if args.rm_type
        else f"--custom-rm-path {args.custom_rm_path}"
        if args.custom_rm_path
        else f"--rm-url {args.rm_url}"
        if args.rm_url
        else "from --custom-generate-function-path"
        if args.custom_generate_function_path
        else "none given"
    )
    return (
        f"rollouts: {args.num_rollout} x {args.rollout_batch_size} prompts x "
        f"{args.n_samples_per_prompt} samples, responses up to {args.rollout_max_response_len} "
        f"tokens, reward {reward}"
    )


def checkpoints_line(args: ParsedArgs) -> str:
    if not args.save:
        line = "checkpoints: none (no --save)"
    elif args.save_interval:
        line = (
            f"checkpoints: {args.save} every {args.save_interval} rollouts and after the last "
            f"(rollout {args.num_rollout})"
        )
    else:
        line = (
            f"checkpoints: {args.save} after the last rollout ({args.num_rollout}) only "
            "(no --save-interval)"
        )
    if args.save and args.save_trigger_sentinel:
        line += f", and whenever {args.save_trigger_sentinel} is created"
    return line


def outputs_line(args: ParsedArgs) -> str:
    parts = []
    if args.metrics_jsonl:
        parts.append(f"metrics {args.metrics_jsonl} (miles plot {run_dir(args)})")
    if args.tensorboard_dir:
        parts.append(f"TensorBoard {args.tensorboard_dir}")
    logs = log_dir(args)
    parts.append(
        f"engine logs {logs}"
        if logs
        else "engine logs in the temp dir (give --metrics-jsonl or --save to keep them)"
    )
    return "outputs: " + "; ".join(parts)


def plan_lines(args: ParsedArgs, use_gpu: bool, notes: list[str] = ()) -> list[str]:
    """The plan of the module docstring (``notes``: the preflight's, e.g. a fresh ``--load``)."""
    layout = plan_layout(args, use_gpu)
    if args.ray_address:
        device = f"the Ray cluster at {args.ray_address} (its GPUs are read when the job starts)"
    elif use_gpu:
        device = "CUDA"
    else:
        device = 'CPU (no CUDA device: every "GPU" below is a CPU slot)'
    nodes = nodes_needed(layout)
    lines = [
        f"plan: --train-backend {args.train_backend}, {device}; {layout.num_bundles} bundle(s) "
        f"on {nodes} node(s) of up to {layout.gpus_per_node} (--num-gpus-per-node)",
        trainer_line(args, layout),
        *filter(None, [critic_line(args, layout)]),
        engines_line(args, layout),
        weights_line(args),
        offload_line(args),
        *plan_memory_lines(args, use_gpu),
        rollouts_line(args),
        checkpoints_line(args),
        *notes,
        outputs_line(args),
    ]
    return [lines[0], *("  " + line for line in lines[1:])]
