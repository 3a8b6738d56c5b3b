"""What the training benchmarks (``bench_fsdp_train.py``, ``bench_megatron_train.py``) share:
a random Qwen3-shaped model written once as a HF directory, synthetic GRPO rollouts, the FLOPs
per token behind MFU, and the timing loop around ``backend.train``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist

VOCAB_SIZE = 151936
# Qwen3's published shapes: hidden, intermediate, layers, query heads, tied embeddings (8 key-value
# heads of dim 128 in every size).
QWEN3_SIZES = {
    "0.6B": (1024, 3072, 28, 16, True),
    "1.7B": (2048, 6144, 28, 16, True),
    "4B": (2560, 9728, 36, 32, True),
    "8B": (4096, 12288, 36, 32, False),
}


def qwen3_config(size: str):
    """Qwen3-``size`` shapes (``QWEN3_SIZES``), rope theta 1e6."""
    from transformers import Qwen3Config

    hidden, intermediate, layers, heads, tied = QWEN3_SIZES[size]
    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=tied,
        rope_theta=1000000.0,
    )


def measure_bf16_peak_tflops(n: int = 8192, iters: int = 10) -> float:
    """The bf16 matmul rate of this GPU, measured now (random ``n x n`` operands, median of
    ``iters`` products after 3 warm-ups, CUDA events): the MFU denominator of the same run."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    times = []
    for i in range(3 + iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    times.sort()
    return 2 * n**3 / times[len(times) // 2] / 1e9


def write_random_model(path: str, config) -> None:
    """A bf16 random model (seed 0) and a two-token tokenizer saved under ``path``."""
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    # initialised on the GPU: transformers' CPU init of a 1.7B model took ~50 s
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "<eos>": 1}, unk_token="<unk>"))
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>"
    ).save_pretrained(path)


def add_timing_flags(parser: argparse.ArgumentParser) -> None:
    """The flags both benchmarks take: work per rollout, timed iterations, the MFU peak."""
    parser.add_argument("--tokens-per-gpu", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per rollout")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=0.0,
        help="bf16 peak per GPU for MFU (0, the default: measured in this run)",
    )
    parser.add_argument("--size", default=None, choices=sorted(QWEN3_SIZES), help="model shape")
    parser.add_argument(
        "--gradient-checkpointing", action="store_true", help="recompute each layer in backward"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the timed rollouts, profile one more of each side: where the GPU time goes "
        "(kernel categories, idle time, host syncs)",
    )


def peak_tflops(args) -> float:
    """``--peak-tflops``, or the bf16 matmul rate measured now when it is 0."""
    if not args.peak_tflops:
        args.peak_tflops = measure_bf16_peak_tflops()
    return args.peak_tflops


def init_nccl() -> tuple[int, int]:
    """The NCCL process group of a ``torchrun`` launch, this rank's GPU set; (rank, world)."""
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return dist.get_rank(), dist.get_world_size()


def shared_model_dir(config, prefix: str) -> str:
    """Rank 0 writes the random model into a fresh temp directory; every rank gets its path
    (the process group must be initialised)."""
    box = [tempfile.mkdtemp(prefix=prefix) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    if dist.get_rank() == 0:
        write_random_model(box[0], config)
    dist.barrier()
    return box[0]


def make_rollout(tokens_per_gpu: int, world: int, steps: int, seed: int):
    """Samples of 512..2048 tokens (half of each is the response), ~tokens_per_gpu per GPU per
    step, groups of 4 with uniform random rewards, each with the log-probs an engine reports
    (``rollout_log_probs``: every rollout of a real job carries them, and the mismatch metrics
    and ``--use-rollout-logprobs`` read them)."""
    from miles_core.batch import RolloutBatch, Sample

    g = torch.Generator().manual_seed(seed)
    samples, total, target = [], 0, tokens_per_gpu * world * steps
    while total < target:
        length = int(torch.randint(512, 2049, (1,), generator=g))
        samples.append(
            Sample(
                tokens=torch.randint(2, VOCAB_SIZE, (length,), generator=g),
                response_length=length // 2,
                reward=float(torch.rand((), generator=g)),
                group_index=len(samples) // 4,
                rollout_log_probs=-2.0 - torch.rand(length // 2, generator=g),
            )
        )
        total += length
    while len(samples) % 4:
        samples.pop()
    return RolloutBatch(samples)


def flops_per_token(cfg, seq_len: float) -> float:
    """Training FLOPs per token: ``6 N + 6 L h d s`` (N the matmul parameters, embedding
    included once; L layers, h heads of dim d, s the mean sequence length)."""
    n_params = (
        cfg.num_hidden_layers
        * (
            cfg.hidden_size
            * cfg.head_dim
            * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
            + 3 * cfg.hidden_size * cfg.intermediate_size
        )
        + cfg.vocab_size * cfg.hidden_size
    )
    attention = 6 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq_len
    return 6 * n_params + attention


def fsdp_backend(
    hf_dir: str,
    max_tokens_per_gpu: int,
    steps: int,
    gradient_checkpointing: bool,
    extra: list[str] | None = None,
):
    """An initialised ``FSDPBackend`` on ``hf_dir`` as the benchmarks train it: bf16, lr 1e-6,
    GRPO, dynamic micro-batches of ``max_tokens_per_gpu``, ``steps`` optimizer steps per rollout,
    then ``extra`` flags."""
    from miles_core.args import core_groups, parse_args
    from miles_fsdp.args import fsdp_groups
    from miles_fsdp.backend import FSDPBackend

    argv = [
        "--hf-checkpoint",
        hf_dir,
        "--bf16",
        "--lr",
        "1e-6",
        "--use-dynamic-batch-size",
        "--max-tokens-per-gpu",
        str(max_tokens_per_gpu),
        "--num-steps-per-rollout",
        str(steps),
        "--advantage-estimator",
        "grpo",
    ]
    if gradient_checkpointing:
        argv.append("--gradient-checkpointing")
    backend = FSDPBackend()
    backend.init(parse_args([*argv, *(extra or [])], [*core_groups(), *fsdp_groups()]))
    return backend


def time_train(backend, shard, warmup: int, iters: int, report=None) -> list[float]:
    """Seconds of each ``backend.train`` call after ``warmup`` untimed ones (CUDA-synchronised);
    ``report(rollout, seconds)``, when given, hears of every call."""
    times = []
    for rollout in range(warmup + iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        backend.train(rollout, shard)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        if rollout >= warmup:
            times.append(seconds)
        if report is not None:
            report(rollout, seconds)
    return times


KERNEL_CATEGORIES = (  # first match wins; names are lower-cased
    ("attention", ("flash", "fmha", "varlen", "attention", "sdpa")),
    ("matmul", ("gemm", "cutlass", "nvjet", "sm90_", "cublas", "matmul")),
    ("communication", ("nccl",)),
    ("copy", ("memcpy", "memset", "copy_", "cat_", "chunk_cat", "split_with_sizes")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("reduction", ("reduce", "norm", "softmax", "logsumexp")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "index", "scatter", "gather")),
)


def kernel_category(name: str) -> str:
    low = name.lower()
    for category, keys in KERNEL_CATEGORIES:
        if any(k in low for k in keys):
            return category
    return "other"


def profile_rollout(run, top: int = 12) -> dict:
    """Run ``run()`` once under torch.profiler: wall seconds, GPU busy seconds (the union of
    kernel intervals), GPU time per kernel category, the top kernels, and the host-side calls
    that block on the GPU (synchronize, blocking copies)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    intervals, by_category, by_kernel = [], {}, {}
    syncs = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            start, end = ev.time_range.start, ev.time_range.end
            if end <= start:
                continue
            intervals.append((start, end))
            us = end - start
            cat = kernel_category(ev.name)
            by_category[cat] = by_category.get(cat, 0.0) + us
            k = by_kernel.setdefault(ev.name[:90], [0, 0.0])
            k[0] += 1
            k[1] += us
        elif ev.name in (
            "cudaStreamSynchronize",
            "cudaDeviceSynchronize",
            "cudaEventSynchronize",
            "cudaMemcpy",
            "aten::item",
            "aten::_local_scalar_dense",
            "cudaFree",  # the caching allocator giving memory back: it waits for the GPU
            "cudaMalloc",  # (counted beside it: the allocator short of cached blocks)
        ):
            s = syncs.setdefault(ev.name, [0, 0.0])
            s[0] += 1
            s[1] += ev.cpu_time_total
    intervals.sort()
    busy, cur_start, cur_end = 0.0, None, None
    for start, end in intervals:
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        busy += cur_end - cur_start
    kernels = sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "wall_s": wall,
        "gpu_busy_s": busy / 1e6,
        "gpu_idle_fraction": max(0.0, 1 - busy / 1e6 / wall),
        "kernel_s_by_category": {k: v / 1e6 for k, v in sorted(by_category.items())},
        "top_kernels": [{"name": n, "calls": c, "seconds": us / 1e6} for n, (c, us) in kernels],
        "host_syncs": {n: {"calls": c, "cpu_s": us / 1e6} for n, (c, us) in syncs.items()},
    }


def sync_sites(run, top: int = 12) -> list[dict]:
    """Run ``run()`` once with CUDA sync debugging on: every operation that makes the host wait
    for the GPU, counted by the innermost miles (or script) frame that called it."""
    import traceback
    import warnings

    counts: dict[str, int] = {}

    def note(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        site = f"{filename}:{lineno}"
        for frame in reversed(traceback.extract_stack()[:-1]):
            if "miles_" in frame.filename or "/scripts/" in frame.filename:
                site = f"{frame.filename.split('/src/')[-1]}:{frame.lineno} {frame.name}"
                break
        counts[site] = counts.get(site, 0) + 1

    saved = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = saved
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
    return [{"site": site, "syncs": n} for site, n in ranked]


def print_profile(side: str, prof: dict) -> None:
    print(
        f"\nprofile of one rollout, {side}: wall {prof['wall_s']:.3f} s, GPU busy "
        f"{prof['gpu_busy_s']:.3f} s (idle {prof['gpu_idle_fraction']:.1%})"
    )
    for cat, s in sorted(prof["kernel_s_by_category"].items(), key=lambda kv: -kv[1]):
        print(f"  {cat:14s} {s:8.3f} s")
    for k in prof["top_kernels"]:
        print(f"  {k['seconds']:8.3f} s {k['calls']:6d}x  {k['name']}")
    for name, s in prof["host_syncs"].items():
        print(f"  host {name}: {s['calls']} calls, {s['cpu_s']:.3f} s")
    for site in prof.get("sync_sites", []):
        print(f"  sync {site['syncs']:5d}x  {site['site']}")
