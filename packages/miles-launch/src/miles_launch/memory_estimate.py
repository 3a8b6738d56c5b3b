"""The arithmetic of the memory plan (:mod:`miles_launch.memory_plan`): peak bytes per trainer
GPU and per trainer rank's host from a model's shape (:class:`~miles_launch.model_shape.ModelShape`)
and a :class:`TrainerLayout` (what the flags say, or what ``scripts/scale_table.py`` picks).

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
  many): every layer's saved tensors (:meth:`ModelShape.layer_activation_bytes` says which: HF's
  layers for FSDP, megatron-core's for Megatron, whose RMSNorms save less on a GPU) without
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
bounded here); :mod:`miles_launch.memory_plan` adds the engine's phases.
Per host: the trainer's sleep backups (``--offload-train``: the cpu target's copy, the disk
target's pinned ring of ``--offload-train-disk-chunk-mb`` chunks), CPU-offloaded state,
CPU-offloaded reference/teacher, and the disk-delta writer's copy of the weights on rank 0's node.

Limits: allocator fragmentation and workspace (cuBLAS, NCCL buffers, the CUDA context: ~0.5-1
GiB) are not counted; FSDP's gradients are counted whole during backward unless every step is
provably one micro-batch per rank (``--micro-batch-size``, or the token budget with
``--rollout-max-prompt-len``), true from a step's second micro-batch on; MoE activations
assume balanced routing; LoRA adapters are not counted (the base is, in the compute dtype). ``scripts/bench_memory_plan.py`` measures the estimate
against ``torch.cuda.max_memory_allocated`` on a GPU node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from miles_core.log_prob_head import CUDA_CHUNK_BYTES, DEFAULT_CHUNK_BYTES

from miles_launch.model_shape import ModelShape

GiB = 2**30
#: Float32 logits of one fused-head chunk on a GPU and on the CPU
#: (``miles_core.log_prob_head.CUDA_CHUNK_BYTES`` / ``DEFAULT_CHUNK_BYTES``, read at use).
FUSED_HEAD_CHUNKS = 4
#: Bytes per ``[tokens, V]`` element of the dense head (see the module docstring).
DENSE_HEAD_BYTES = 18
#: Streamed optimizer buckets resident on the device at once.
STREAMED_BUCKETS = 3
#: Pinned staging chunks of the disk sleep target per rank (miles-offload's
#: ``OffloadTarget.ring_chunks``; miles-launch does not import miles-offload).
DISK_RING_CHUNKS = 4


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
    recompute_method: str = "uniform"  # full: "uniform" | "block" (FSDP: the first N layers)
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
    disk_chunk_bytes: int = 256 * 2**20  # --offload-train-disk-chunk-mb
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

    layers = "megatron" if lay.backend == "megatron" else "hf"
    fused_norm = lay.backend == "megatron" and lay.on_cuda  # HF's norm is Python: no fused kernel

    def layer(kind: bool) -> float:
        hidden_part, split_part = shape.layer_activation_split(kind, c, layers, fused_norm)
        return (hidden_part / (tp if lay.sequence_parallel else 1)) + split_part / tp

    full = dense * (layer(False) if dense else 0) + sparse * (layer(True) if sparse else 0)
    one = max(layer(False) if dense else 0, layer(True) if sparse else 0)
    checkpoint = c * h / (tp if lay.sequence_parallel else 1)
    # ``stored``: what each micro-batch in flight keeps; ``working``: the layers being recomputed
    # (one micro-batch's backward at a time)
    working = 0.0
    if recompute == "full":
        n = max(1, lay.recompute_layers)
        if lay.recompute_method == "block":  # Megatron's block, FSDP's first N layers
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
    vocab = shape.vocab / (lay.tp if lay.backend == "megatron" else 1)
    dense = lay.tokens * vocab * DENSE_HEAD_BYTES
    if not lay.fused_head:
        return dense
    chunk = CUDA_CHUNK_BYTES if lay.on_cuda else DEFAULT_CHUNK_BYTES
    return min(dense, FUSED_HEAD_CHUNKS * chunk) + 4 * vocab * shape.hidden


# ---------------------------------------------------------------------- the whole trainer GPU
def trainer_estimate(shape: ModelShape, lay: TrainerLayout) -> tuple[Estimate, Estimate]:
    """``(trainer GPU, trainer rank's host)`` estimates of a layout; the GPU's phases are
    ``training``, ``optimizer step`` and ``publishing`` (the caller adds the engine's under
    ``--colocate``)."""
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
        critic = replace(shape, tied=True)  # the input embedding, no LM head (its value head: h)
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
    elif lay.offload_train == "disk":
        host.terms["disk sleep's pinned ring"] = DISK_RING_CHUNKS * lay.disk_chunk_bytes
    return gpu, host
