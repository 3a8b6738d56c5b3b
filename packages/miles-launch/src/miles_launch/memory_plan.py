"""The memory plan: an estimate of peak memory per GPU and per host, from ``config.json`` and the
flags alone (no model is loaded), printed in the plan (``--dry-run`` and the first lines of every
run) and checked against the GPU by the preflight, before Ray starts::

    memory: trainer GPU ~64.0 GiB at peak (generation), fits 80.0 GiB (--gpu-memory-gib); training: parameters 3.8 GiB, ...
    memory: engines: colocated, in the trainer GPU's phases (SGLang, --sglang-mem-fraction-static 0.8 (64.0 GiB) of the device; ...)
    memory: host per trainer node ~91.5 GiB: 8 rank(s) x (sleep backups 11.4 GiB)

:func:`trainer_layout` reads the flags of either backend into a
:class:`~miles_launch.memory_estimate.TrainerLayout`; the arithmetic is
:mod:`miles_launch.memory_estimate`'s. :func:`job_memory` adds the engine (SGLang's
``--sglang-mem-fraction-static`` of its GPU; the built-in engine's weights) and, under
``--colocate``, the phases trainer and engine share: training (plus the engine unless
``--offload-rollout``), generation (the engine plus the trainer unless ``--offload-train``),
publishing (plus the engine's weights). The device: ``--gpu-memory-gib``, else the local CUDA
device when the job runs here, else none (the estimate is printed unchecked).
:func:`check_memory` refuses a trainer GPU over the device, and engine weights over the engine's
room on a GPU of the same size, unless ``--ignore-memory-plan``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from miles_core.args import ArgumentError
from miles_core.args.parsed import ParsedArgs
from miles_core.precision import explicit_dtype_name, train_dtype_name

from miles_launch.memory_estimate import (
    Estimate,
    GiB,
    TrainerLayout,
    activation_bytes,
    trainer_estimate,
)
from miles_launch.model_shape import ConfigError, ModelShape
from miles_launch.placement import critic_ranks


# ---------------------------------------------------------------------- from the flags
def trainer_layout(args: ParsedArgs, on_cuda: bool) -> TrainerLayout | None:
    """The :class:`TrainerLayout` of parsed flags (None for a backend this plan does not know)."""
    dtype = train_dtype_name(args)
    if args.train_backend == "fsdp":  # its own flag decides when the command line names none
        dtype = explicit_dtype_name(args) or args.fsdp_compute_dtype or dtype
    c = 4 if dtype == "fp32" else 2
    ranks = args.actor_num_nodes * args.actor_num_gpus_per_node
    tokens = args.max_tokens_per_gpu or _longest_sample(args) * args.micro_batch_size
    common = dict(
        one_micro_batch=_one_micro_batch(args, ranks, tokens),
        ranks=ranks,
        tokens=tokens,
        fused_head=args.fused_log_probs,
        on_cuda=on_cuda,
        compute_bytes=c,
        stream_bucket_numel=(
            args.stream_optimizer_bucket_numel if args.stream_optimizer_state_to_disk else 0
        ),
        stream_moment_bytes=4 if args.stream_optimizer_state_moment_dtype == "fp32" else 2,
        lora=args.use_lora,
        ema=args.use_ema,
        critic=args.use_critic and not critic_ranks(args),  # not on its own GPUs
        ref=("none" if args.ref_mode != "ref" else "host" if args.ref_cpu_offload else "gpu"),
        offload_train=args.offload_train_target if args.offload_train else "none",
        disk_chunk_bytes=args.offload_train_disk_chunk_mb * 2**20,
        publish_buffer=args.update_weight_buffer_size,
    )
    if args.train_backend == "fsdp":
        teacher_shape = None
        if args.teacher_load and (Path(args.teacher_load) / "config.json").is_file():
            teacher_shape = ModelShape.from_hf_dir(args.teacher_load)
        return TrainerLayout(
            backend="fsdp",
            dp_replicate=args.dp_replicate_size,
            recompute="full" if args.gradient_checkpointing else "none",
            recompute_method="block" if args.gradient_checkpointing_layers else "uniform",
            recompute_layers=args.gradient_checkpointing_layers or 1,
            master_bytes=4 if args.keep_fp32_master else c,
            fsdp_cpu_offload=args.fsdp_cpu_offload,
            teacher=(
                "none" if not args.teacher_load else "host" if args.teacher_cpu_offload else "gpu"
            ),
            teacher_shape=teacher_shape,
            **common,
        )
    if args.train_backend == "megatron":
        fraction = 0.0
        if args.optimizer_cpu_offload:
            given = args.optimizer_offload_fraction
            fraction = 1.0 if given is None else given
        return TrainerLayout(
            backend="megatron",
            tp=args.tensor_model_parallel_size,
            pp=args.pipeline_model_parallel_size,
            cp=args.context_parallel_size,
            ep=args.expert_model_parallel_size,
            etp=args.expert_tensor_parallel_size or args.tensor_model_parallel_size,
            sequence_parallel=args.sequence_parallel,
            recompute=args.recompute_granularity or "none",
            recompute_method=args.recompute_method or "uniform",
            recompute_layers=args.recompute_num_layers or 1,
            grad_bytes=2 if args.grad_reduce_in_fp32 is False else 4,
            optimizer_host_fraction=fraction,
            # its reference is a host copy of the rank's shards, swapped in for its pass
            **{**common, "ref": "host" if args.ref_mode == "ref" else "none"},
        )
    return None


def _one_micro_batch(args: ParsedArgs, ranks: int, tokens: int) -> bool:
    """Whether every optimizer step is provably one micro-batch on each data-parallel rank:
    without ``--use-dynamic-batch-size``, a step's samples on a rank fit ``--micro-batch-size``;
    with it, they fit the token budget at their longest (``--rollout-max-prompt-len`` given)."""
    model_parallel = 1
    if args.train_backend == "megatron":
        model_parallel = (
            args.tensor_model_parallel_size
            * args.pipeline_model_parallel_size
            * args.context_parallel_size
        )
    per_step = args.rollout_batch_size * args.n_samples_per_prompt / args.num_steps_per_rollout
    per_rank = math.ceil(per_step / max(1, ranks // model_parallel))
    if not args.use_dynamic_batch_size:
        return per_rank <= args.micro_batch_size
    return bool(args.rollout_max_prompt_len) and per_rank * _longest_sample(args) <= tokens


def _longest_sample(args: ParsedArgs) -> int:
    """Tokens of the longest sample (prompt + response) when no token budget is given."""
    prompt = args.rollout_max_prompt_len or 0
    return max(1, prompt + (args.rollout_max_response_len or 0))


# ---------------------------------------------------------------------- the job
@dataclass
class JobMemory:
    """The job's estimate: the trainer GPU (with the engine's share when colocated), the
    engine's GPU, the trainer nodes' host memory, and the device it is checked against."""

    trainer: Estimate
    host_per_rank: Estimate
    host_per_node: float
    ranks_per_node: int
    engine_line: str
    device: tuple[float, str] | None
    recompute: str
    activations_without_recompute: float
    tokens: int
    head: str
    engine_weights: float = 0.0  # one engine GPU's share of the weights
    engine_room: float | None = None  # what the engine may hold on its GPU, when known

    def exceeds(self) -> bool:
        return self.device is not None and self.trainer.peak > self.device[0]

    def engine_exceeds(self) -> bool:
        """The engine's weights alone exceed its room (SGLang's fraction of the device, or the
        device for the built-in engine): the engine could not start. Engine GPUs are taken to
        be the trainer's kind."""
        return self.engine_room is not None and self.engine_weights > self.engine_room


def device_memory(args: ParsedArgs, use_gpu: bool) -> tuple[float, str] | None:
    """``(bytes, where it came from)`` of one trainer GPU: ``--gpu-memory-gib``, else the local
    CUDA device's (a local job), else None (not checked)."""
    if args.gpu_memory_gib is not None:
        return args.gpu_memory_gib * GiB, "--gpu-memory-gib"
    memory = local_gpu_memory() if use_gpu and not args.ray_address else None
    return (memory, "CUDA device 0") if memory else None


def local_gpu_memory() -> float | None:
    """Bytes of this machine's first CUDA device (None without one)."""
    if not torch.cuda.is_available():
        return None
    return float(torch.cuda.get_device_properties(0).total_memory)


def engine_weights(shape: ModelShape) -> float:
    """Bytes of the engines' weights (bf16, the whole model)."""
    return 2.0 * shape.total_params()


class NoEstimate(Exception):
    """The job has no estimate (the message says why: no config.json, a model type or backend
    the plan does not count)."""


def job_memory(args: ParsedArgs, use_gpu: bool) -> JobMemory:
    """The estimate of the parsed job; raises :class:`NoEstimate`."""
    if not args.hf_checkpoint:
        raise NoEstimate("no --hf-checkpoint")
    try:
        shape = ModelShape.from_hf_dir(args.hf_checkpoint)
    except OSError as exc:
        raise NoEstimate(f"{args.hf_checkpoint}/config.json not read ({exc.strerror})") from None
    except (ValueError, ConfigError) as exc:  # ConfigError is a ValueError; so is bad JSON
        raise NoEstimate(str(exc)) from None
    lay = trainer_layout(args, use_gpu)
    if lay is None:
        raise NoEstimate(f"--train-backend {args.train_backend} is not one the plan counts")
    trainer, host = trainer_estimate(shape, lay)
    device = device_memory(args, use_gpu)
    replay = bool(args.load_debug_rollout_data)
    weights = engine_weights(shape) / args.rollout_num_gpus_per_engine
    fraction = args.sglang_mem_fraction_static
    room = None
    if replay:
        engine, engine_bytes = "engines: none", 0.0
    elif args.rollout_engine == "sglang":
        room = fraction * device[0] if fraction is not None and device else None
        engine_bytes = fraction * device[0] if fraction is not None and device else weights
        if fraction is None:
            share = "SGLang's own --mem-fraction-static (--sglang-mem-fraction-static unset)"
        else:
            share = f"--sglang-mem-fraction-static {fraction}"
            share += f" ({size(engine_bytes)})" if device else ""
        engine = f"engine GPU: SGLang, {share} of the device; its weights {size(weights)} of it"
    else:
        engine_bytes, room = weights, device[0] if device else None
        engine = (
            f"engine GPU: built-in engine, weights {size(weights)} plus a KV cache that "
            "grows with the batch (not bounded here)"
        )
    if args.colocate and not replay:
        static = sum(
            v
            for k, v in trainer.terms.items()
            if k not in ("activations", "log-prob head", "gathered")
        )
        engine_during_train = 0.0 if args.offload_rollout else engine_bytes
        trainer.phases["training"] += engine_during_train
        trainer.phases["generation"] = engine_bytes + (0.0 if args.offload_train else static)
        trainer.phases["publishing"] += weights  # the engine's weights are back for the publish
        engine = (
            "engines: colocated, in the trainer GPU's phases ("
            + engine.removeprefix("engine GPU: ")
            + ")"
        )
    ranks_per_node = args.actor_num_gpus_per_node
    per_node = sum(host.terms.values()) * ranks_per_node
    if args.update_weight_transfer_mode == "disk-delta":
        host.notes.append(f"disk-delta writer {size(engine_weights(shape))} on rank 0's node")
        per_node += engine_weights(shape)
    return JobMemory(
        trainer=trainer,
        host_per_rank=host,
        host_per_node=per_node,
        ranks_per_node=ranks_per_node,
        engine_line=engine,
        device=device,
        recompute=lay.recompute,
        activations_without_recompute=activation_bytes(shape, lay, "none"),
        tokens=lay.tokens,
        head="fused" if lay.fused_head else "dense",
        engine_weights=0.0 if replay else weights,
        engine_room=room,
    )


def size(value: float) -> str:
    """``value`` bytes in GiB with one decimal, or in MiB / KiB below one GiB / MiB."""
    for unit, scale in (("GiB", GiB), ("MiB", 2**20)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value / 2**10:.1f} KiB"


def plan_memory_lines(args: ParsedArgs, use_gpu: bool) -> list[str]:
    """The plan's memory lines of the parsed job, or one saying why there is no estimate."""
    try:
        return memory_lines(job_memory(args, use_gpu))
    except NoEstimate as exc:
        return [f"memory: no estimate ({exc}); not checked"]


def memory_lines(job: JobMemory) -> list[str]:
    """The plan's memory lines (module docstring): the trainer GPU, the engine, the host."""
    t = job.trainer
    if job.device is None:
        against = "not checked (no local GPU, no --gpu-memory-gib)"
    else:
        verdict = "over the" if job.exceeds() else "fits"
        against = f"{verdict} {size(job.device[0])} ({job.device[1]})"
    parts = []
    for name, value in t.terms.items():
        if name == "activations":
            how = (
                f"recompute; {size(job.activations_without_recompute)} without"
                if job.recompute == "full"
                else "no recompute"
            )
            parts.append(f"activations {size(value)} at {job.tokens} tokens ({how})")
        elif name == "log-prob head":
            parts.append(f"log-prob head {size(value)} ({job.head})")
        else:
            parts.append(f"{name} {size(value)}")
    others = ", ".join(f"{k} {size(v)}" for k, v in t.phases.items() if k != "training")
    lines = [
        f"memory: trainer GPU ~{size(t.peak)} at peak ({t.peak_phase}), {against}; training: "
        + ", ".join(parts)
        + (f"; {others}" if others else ""),
        "memory: " + job.engine_line,
    ]
    host = job.host_per_rank
    if host.terms or host.notes:
        what = ", ".join(f"{k} {size(v)}" for k, v in host.terms.items())
        lines.append(
            f"memory: host per trainer node ~{size(job.host_per_node)}"
            + (f": {job.ranks_per_node} rank(s) x ({what})" if what else "")
            + "".join(f"; {note}" for note in host.notes)
        )
    else:
        lines.append("memory: host per trainer node: no trainer state (nothing offloaded to it)")
    return lines


def check_memory(args: ParsedArgs, use_gpu: bool) -> None:
    """Refuse (an ``ArgumentError`` naming ``--ignore-memory-plan``) a job whose trainer GPU
    estimate exceeds the device, or whose engine's weights exceed the engine's room on it; and
    ``--ignore-memory-plan`` itself where nothing is checked (no estimate, or no device memory
    known), since it would change nothing there."""
    try:
        job = job_memory(args, use_gpu)
    except NoEstimate as exc:
        if args.ignore_memory_plan:  # nothing is checked: the flag would be inert
            raise ArgumentError(
                f"--ignore-memory-plan: the plan checks nothing here: {exc}"
            ) from None
        return  # the plan says why
    if args.ignore_memory_plan:
        if job.device is None:
            raise ArgumentError(
                "--ignore-memory-plan: the plan checks nothing here: no trainer GPU memory is "
                "known (no local CUDA device, or a driver with --ray-address); pass "
                "--gpu-memory-gib to check against one"
            )
        return
    device = f"{size(job.device[0])} ({job.device[1]})" if job.device else ""
    if job.exceeds():
        t = job.trainer
        biggest = sorted(t.terms.items(), key=lambda kv: -kv[1])[:3]
        raise ArgumentError(
            f"the memory plan estimates {size(t.peak)} per trainer GPU at its peak "
            f"({t.peak_phase}; the largest terms: "
            + ", ".join(f"{k} {size(v)}" for k, v in biggest)
            + f") and the GPU has {device}: lower --max-tokens-per-gpu, recompute activations, "
            "add trainer GPUs or offload, or pass --ignore-memory-plan to start anyway"
        )
    if job.engine_exceeds():
        way = (
            "raise --sglang-mem-fraction-static or --rollout-num-gpus-per-engine"
            if args.rollout_engine == "sglang"
            else "the built-in engine serves on one GPU: use --rollout-engine sglang with "
            "--rollout-num-gpus-per-engine"
        )
        raise ArgumentError(
            f"the memory plan: an engine GPU's share of the weights, {size(job.engine_weights)}, "
            f"exceeds the {size(job.engine_room)} the engine may use on a GPU of {device}: "
            f"{way}, or pass --ignore-memory-plan to start anyway"
        )
