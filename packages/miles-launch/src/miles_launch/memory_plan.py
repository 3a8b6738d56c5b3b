"""The memory plan: an estimate of peak memory per GPU and per host, from ``config.json`` and the
flags alone, printed in the plan (``--dry-run`` and the first lines of every run) and checked
against the GPU before Ray starts::

    memory: trainer GPU ~61.3 GiB peak (training) of 79.1 GiB (CUDA device 0): parameters 15.0,
        gradients 15.0, optimizer 30.0, activations 5.9 at 16384 tokens (recompute; 78.1
        without), log-prob head 3.5 (fused), gathered 1.5
    memory: engine GPU: SGLang --sglang-mem-fraction-static 0.8 of the device (64.0 GiB)
    memory: host per node: 8 trainer rank(s) x 60.0 GiB (sleep backups) = 480.0 GiB

One code path for both backends (``--train-backend fsdp`` / ``megatron``); per trainer GPU, with
``P`` the parameters (:class:`~miles_launch.model_shape.ModelShape`), ``c`` the compute dtype's
bytes (2 for bf16) and the shards each backend cuts:

* **FSDP** (``S`` = ranks / ``--dp-replicate-size`` shards): parameters ``P m / S`` (``m`` = 4
  with fp32 masters, ``c`` under ``--no-keep-fp32-master``), gradients ``P m / S``, AdamW's two
  moments ``2 P m / S``; the gathered units: the root (tied embedding) and two layers in ``c``
  (the one running and the one prefetched) and the largest unit's unsharded gradient
  (``c`` + its fp32 copy for the reduce-scatter). ``--fsdp-cpu-offload`` puts parameters,
  gradients and moments in host memory.
* **Megatron** (``TP``/``PP``/``CP``/``EP``/``ETP``; ``DP = ranks / (TP PP CP)``): on the
  fullest pipeline stage, bf16 parameters ``c P_local`` and the DDP gradient buffer ``4 P_local``
  (``2`` under ``--no-grad-reduce-in-fp32``), with ``P_local`` = the stage's dense parameters / TP
  plus its routed experts / (EP ETP); the distributed optimizer's fp32 master and two moments,
  ``12 P_dense / (TP PP DP CP)`` + ``12 P_experts / (EP ETP PP EDP)``. ``--optimizer-cpu-offload``
  moves ``--optimizer-offload-fraction`` of it to the host.
* ``--stream-optimizer-state-to-disk``: masters and moments in files; at most 3 buckets of
  ``--stream-optimizer-bucket-numel`` on the GPU.
* **Activations** of one micro-batch of ``--max-tokens-per-gpu`` tokens (each CP rank holds that
  many): every layer's saved tensors (:meth:`ModelShape.layer_activation_bytes` says which) without
  recompute; with ``--gradient-checkpointing`` (FSDP) or ``--recompute-granularity full``
  (Megatron) the checkpointed inputs (``c h`` per token per checkpoint) plus the recomputed
  layers. Megatron divides by TP under ``--sequence-parallel`` (without it only the head- and
  MLP-sized tensors), and its first pipeline stage holds ``PP`` micro-batches in flight. Plus the
  final norm and the head's input gradient, ``(8 + 3c) h`` per token.
* **Log-prob head**: dense (``--no-fused-log-probs``): 18 bytes per ``[tokens, V / TP]`` element
  (the bf16 logits, their fp32 copy and log-softmax, and the two fp32 gradients: ~2.5 GiB per
  1k tokens at V = 151,936, as measured); fused: four chunks of fp32 logits
  (:data:`miles_core.log_prob_head.CUDA_CHUNK_BYTES` each on a GPU) and the weight's fp32
  gradient accumulator ``4 V h / TP``.
* the reference (``--ref-load``), teacher and EMA copies, a critic's state (``--use-critic``: its
  parameters, gradients and optimizer again), and **publishing**: two ``--update-weight-buffer-size``
  buckets and the largest tensor (the embedding) on top of what the trainer holds then (nothing
  when it sleeps).

The trainer GPU's peak is the largest of its phases: training (everything above), the optimizer
step, publishing, and, colocated, generation (the engine's fraction plus whatever the trainer
keeps awake). The engine: SGLang takes ``--sglang-mem-fraction-static`` of its GPU (its weights
must fit in it); the built-in engine its weights plus a KV cache that grows with the batch (not
bounded here). :func:`check_memory` refuses a trainer GPU over the device, and engine weights
over the engine's room on a GPU of the same size.
Per host: the trainer's sleep backups (``--offload-train``, cpu target), CPU-offloaded state,
CPU-offloaded reference/teacher, and the disk-delta writer's copy of the weights on rank 0's node.

Limits: allocator fragmentation and workspace (cuBLAS, NCCL buffers, the CUDA context: ~0.5-1
GiB) are not counted; FSDP's gradients are counted whole during backward unless every step is
provably one micro-batch per rank (``--micro-batch-size``, or the token budget with
``--rollout-max-prompt-len``), true from a step's second micro-batch on; MoE activations assume balanced routing; LoRA adapters are not counted
(the base is, in the compute dtype). ``scripts/bench_memory_plan.py`` measures the estimate
against ``torch.cuda.max_memory_allocated`` on a GPU node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from miles_launch.model_shape import ConfigError, ModelShape

GiB = 2**30
#: Float32 logits of one fused-head chunk on a GPU and on the CPU
#: (``miles_core.log_prob_head.CUDA_CHUNK_BYTES`` / ``DEFAULT_CHUNK_BYTES``, read at use).
FUSED_HEAD_CHUNKS = 4
#: Bytes per ``[tokens, V]`` element of the dense head (see the module docstring).
DENSE_HEAD_BYTES = 18
#: Streamed optimizer buckets resident on the device at once.
STREAMED_BUCKETS = 3


@dataclass(frozen=True)
class TrainerLayout:
    """What the estimate reads from the flags, so that a table (``scripts/scale_table.py``) can
    build one without a command line. Sizes are counts; bytes are per element."""

    backend: str  # "fsdp" | "megatron"
    ranks: int
    tokens: int  # tokens of one micro-batch per GPU
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False
    dp_replicate: int = 1
    recompute: str = "none"  # "none" | "full" | "selective"
    recompute_method: str = "uniform"  # Megatron full: "uniform" | "block"
    recompute_layers: int = 1
    fused_head: bool = True
    on_cuda: bool = True
    compute_bytes: int = 2
    master_bytes: int = 4
    grad_bytes: int = 4  # Megatron's DDP buffer (fp32 unless --no-grad-reduce-in-fp32)
    optimizer_host_fraction: float = 0.0  # Megatron --optimizer-cpu-offload
    fsdp_cpu_offload: bool = False
    stream_bucket_numel: int = 0  # > 0: --stream-optimizer-state-to-disk
    stream_moment_bytes: int = 4
    lora: bool = False
    ema: bool = False
    critic: bool = False
    ref: str = "none"  # "none" | "gpu" | "host"
    teacher: str = "none"
    teacher_shape: ModelShape | None = None
    offload_train: str = "none"  # "none" | "cpu" | "disk"
    one_micro_batch: bool = False  # each optimizer step is one micro-batch per rank
    publish_buffer: int = 512 * 2**20

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        return max(1, self.ranks // self.model_parallel)

    @property
    def expert_dp(self) -> int:
        return max(1, self.ranks // (self.etp * self.ep * self.pp))


@dataclass
class Estimate:
    """Bytes by term (in print order) and the peak of each phase of one device or host."""

    terms: dict[str, float] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> float:
        return max(self.phases.values(), default=sum(self.terms.values()))

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get) if self.phases else "all"


# ---------------------------------------------------------------------- the trainer's state
def _local_params(shape: ModelShape, lay: TrainerLayout) -> tuple[float, float]:
    """``(dense, experts)`` parameters one rank holds on the fullest pipeline stage (Megatron),
    or its FSDP shard."""
    if lay.backend == "fsdp":
        shards = lay.ranks // lay.dp_replicate
        total = shape.total_params()
        return (total - shape.expert_params()) / shards, shape.expert_params() / shards
    per_stage = math.ceil(shape.layers / lay.pp)
    sparse = shape.sparse_layers * per_stage / shape.layers
    dense_layers = per_stage - sparse
    layers = dense_layers * shape.layer_params(False) + sparse * (
        shape.layer_params(True) - shape.routed_expert_params()
    )
    embeddings = shape.embedding_params() * (1 if lay.pp > 1 or shape.tied else 2)
    dense = (layers + embeddings) / lay.tp + shape.hidden
    experts = sparse * shape.routed_expert_params() / (lay.ep * lay.etp)
    return dense, experts


def state_terms(shape: ModelShape, lay: TrainerLayout) -> tuple[dict[str, float], dict[str, float]]:
    """Per trainer GPU and per trainer rank's host: parameters, gradients, optimizer (module
    docstring)."""
    dense, experts = _local_params(shape, lay)
    local = dense + experts
    gpu: dict[str, float] = {}
    host: dict[str, float] = {}
    c = lay.compute_bytes
    if lay.lora:  # the frozen base in the compute dtype; adapters not counted
        gpu["parameters"] = local * c
        return gpu, host
    if lay.backend == "fsdp":
        m = lay.master_bytes
        gpu["parameters"], gpu["gradients"] = local * m, local * m
        moments = 2 * local * m
        if lay.fsdp_cpu_offload:
            host["parameters, gradients, optimizer (--fsdp-cpu-offload)"] = 4 * local * m
            gpu.pop("parameters"), gpu.pop("gradients")
            moments = 0.0
    else:
        gpu["parameters"], gpu["gradients"] = local * c, local * lay.grad_bytes
        sharded = dense / (lay.dp * lay.cp) + experts / lay.expert_dp
        moments = 12 * sharded
        if lay.optimizer_host_fraction:
            host["optimizer (--optimizer-cpu-offload)"] = moments * lay.optimizer_host_fraction
            moments *= 1 - lay.optimizer_host_fraction
    if lay.stream_bucket_numel:
        bucket = lay.stream_bucket_numel * (lay.master_bytes + 2 * lay.stream_moment_bytes)
        moments = min(moments, STREAMED_BUCKETS * bucket)
    if moments:
        gpu["optimizer"] = moments
    return gpu, host


def _gathered(shape: ModelShape, lay: TrainerLayout) -> float:
    """FSDP's unsharded units (module docstring); Megatron holds its parameters whole."""
    if (
        lay.backend != "fsdp"
        or lay.ranks // lay.dp_replicate == 1
        and lay.master_bytes == lay.compute_bytes
    ):
        return 0.0
    c = lay.compute_bytes
    layer = max(
        shape.layer_params(False) if shape.dense_layers else 0,
        shape.layer_params(True) if shape.sparse_layers else 0,
    )
    root = shape.embedding_params() if shape.tied else 0
    unit = max(layer, shape.embedding_params())
    return (root + 2 * layer) * c + unit * (c + 4)


# ---------------------------------------------------------------------- activations
def activation_bytes(shape: ModelShape, lay: TrainerLayout, recompute: str | None = None) -> float:
    """Saved activations of one micro-batch of ``lay.tokens`` tokens on the fullest stage (module
    docstring); ``recompute`` overrides the layout's ("none", "full", "selective")."""
    recompute = lay.recompute if recompute is None else recompute
    c, h, t = lay.compute_bytes, shape.hidden, lay.tokens
    per_stage = math.ceil(shape.layers / lay.pp)
    sparse = shape.sparse_layers * per_stage / shape.layers
    dense = per_stage - sparse
    tp = lay.tp if lay.backend == "megatron" else 1

    def layer(kind: bool) -> float:
        hidden_part, split_part = shape.layer_activation_split(kind, c)
        return (hidden_part / (tp if lay.sequence_parallel else 1)) + split_part / tp

    full = dense * (layer(False) if dense else 0) + sparse * (layer(True) if sparse else 0)
    one = max(layer(False) if dense else 0, layer(True) if sparse else 0)
    checkpoint = c * h / (tp if lay.sequence_parallel else 1)
    # ``stored``: what each micro-batch in flight keeps; ``working``: the layers being recomputed
    # (one micro-batch's backward at a time)
    working = 0.0
    if recompute == "full":
        n = max(1, lay.recompute_layers)
        if lay.backend == "megatron" and lay.recompute_method == "block":
            kept = max(0.0, per_stage - n)
            stored, working = n * checkpoint + kept * full / per_stage, one
        else:
            stored, working = math.ceil(per_stage / n) * checkpoint, n * one
    else:  # selective recomputes core attention only: with flash kernels, nothing large
        stored = full
    in_flight = lay.pp if lay.backend == "megatron" else 1
    return t * (stored * in_flight + working + (8 + 3 * c) * h)


def head_bytes(shape: ModelShape, lay: TrainerLayout) -> float:
    """The log-prob head's temporaries (module docstring)."""
    from miles_core.log_prob_head import CUDA_CHUNK_BYTES, DEFAULT_CHUNK_BYTES

    vocab = shape.vocab / (lay.tp if lay.backend == "megatron" else 1)
    dense = lay.tokens * vocab * DENSE_HEAD_BYTES
    if not lay.fused_head:
        return dense
    chunk = CUDA_CHUNK_BYTES if lay.on_cuda else DEFAULT_CHUNK_BYTES
    return min(dense, FUSED_HEAD_CHUNKS * chunk) + 4 * vocab * shape.hidden


# ---------------------------------------------------------------------- the whole trainer GPU
def trainer_estimate(shape: ModelShape, lay: TrainerLayout) -> tuple[Estimate, Estimate]:
    """``(trainer GPU, trainer rank's host)`` estimates of a layout; the GPU's phases are
    ``training`` and ``publishing`` (the caller adds the engine's under ``--colocate``)."""
    gpu_terms, host_terms = state_terms(shape, lay)
    gpu = Estimate(terms=dict(gpu_terms))
    host = Estimate(terms=dict(host_terms))
    shards = lay.ranks // lay.dp_replicate if lay.backend == "fsdp" else lay.tp * lay.pp
    for role, where, role_shape in (
        ("reference", lay.ref, shape),
        ("teacher", lay.teacher, lay.teacher_shape or shape),
    ):
        if where != "none":
            copy = role_shape.total_params() * lay.compute_bytes / shards
            (gpu if where == "gpu" else host).terms[role] = copy
    if lay.ema:
        gpu.terms["EMA"] = sum(_local_params(shape, lay)) * lay.master_bytes
    if lay.critic:
        critic = replace(shape, vocab=1, tied=False)
        critic_gpu, critic_host = state_terms(critic, lay)
        gpu.terms["critic"] = sum(critic_gpu.values())
        if critic_host:
            host.terms["critic"] = sum(critic_host.values())
    static = sum(gpu.terms.values())
    gathered = _gathered(shape, lay)
    act = activation_bytes(shape, lay)
    head = head_bytes(shape, lay)
    gpu.terms["activations"] = act
    gpu.terms["log-prob head"] = head
    if gathered:
        gpu.terms["gathered"] = gathered
    # FSDP's gradients exist whole from a step's second micro-batch on; a step of one
    # micro-batch peaks in its backward before they do, or in the optimizer step after.
    # Megatron's DDP gradient buffer is allocated once and kept.
    fsdp_single = lay.backend == "fsdp" and lay.one_micro_batch
    grads = gpu_terms.get("gradients", 0.0) if fsdp_single else 0.0
    gpu.phases["training"] = static - grads + gathered + act + head
    gpu.phases["optimizer step"] = static
    weights = shape.total_params() * lay.compute_bytes
    publish = 2 * min(lay.publish_buffer, weights) + shape.embedding_params() * lay.compute_bytes
    awake = 0.0 if lay.offload_train != "none" else static
    gpu.phases["publishing"] = awake + publish
    if lay.offload_train == "cpu":
        host.terms["sleep backups"] = static - gpu_terms.get("gradients", 0.0)
    return gpu, host


# ---------------------------------------------------------------------- from the flags
def trainer_layout(args: Any, on_cuda: bool) -> TrainerLayout | None:
    """The :class:`TrainerLayout` of parsed flags (None for a backend this plan does not know)."""
    from miles_core.precision import explicit_dtype_name, train_dtype_name

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
        critic=args.use_critic,
        ref=("none" if args.ref_mode != "ref" else "host" if args.ref_cpu_offload else "gpu"),
        offload_train=args.offload_train_target if args.offload_train else "none",
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
            **common,
        )
    return None


def _one_micro_batch(args: Any, ranks: int, tokens: int) -> bool:
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


def _longest_sample(args: Any) -> int:
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


def device_memory(args: Any, use_gpu: bool) -> tuple[float, str] | None:
    """``(bytes, where it came from)`` of one trainer GPU: ``--gpu-memory-gib``, else the local
    CUDA device's (a local job), else None (not checked)."""
    if args.gpu_memory_gib is not None:
        return args.gpu_memory_gib * GiB, "--gpu-memory-gib"
    memory = local_gpu_memory() if use_gpu and not args.ray_address else None
    return (memory, "CUDA device 0") if memory else None


def local_gpu_memory() -> float | None:
    """Bytes of this machine's first CUDA device (None without one)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return float(torch.cuda.get_device_properties(0).total_memory)


def engine_weights(shape: ModelShape) -> float:
    """Bytes of the engines' weights (bf16, the whole model)."""
    return 2.0 * shape.total_params()


def job_memory(args: Any, use_gpu: bool) -> JobMemory | None:
    """The estimate of the parsed job (None: no config.json to read, or a backend it does not
    know)."""
    if not args.hf_checkpoint:
        return None
    try:
        shape = ModelShape.from_hf_dir(args.hf_checkpoint)
    except (OSError, ValueError, ConfigError):
        return None
    lay = trainer_layout(args, use_gpu)
    if lay is None:
        return None
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


def memory_lines(job: JobMemory | None) -> list[str]:
    """The plan's memory lines (module docstring): the trainer GPU, the engine, the host."""
    if job is None:
        return ["memory: no estimate (no config.json read, or a backend the plan does not know)"]
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
        lines.append("memory: host per trainer node: no trainer state (nothing offloaded)")
    return lines


def check_memory(args: Any, use_gpu: bool) -> None:
    """Refuse (an ``ArgumentError`` naming ``--ignore-memory-plan``) a job whose trainer GPU
    estimate exceeds the device, or whose engine's weights exceed the engine's room on it."""
    from miles_core.args import ArgumentError

    if args.ignore_memory_plan:
        return
    job = job_memory(args, use_gpu)
    if job is None:
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
