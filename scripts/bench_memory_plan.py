"""Benchmark: the memory plan's estimate per trainer GPU (``miles_launch.memory_plan``, what
``miles train`` prints and checks) against the peak memory training really takes, for both
backends at two model shapes, with and without recompute.

On a GPU node (one GPU; the target is estimate / measured within 10%)::

    torchrun --nproc-per-node 1 scripts/bench_memory_plan.py --out memory_plan.json

On the CPU (gloo, a tiny model: checks the path, measures nothing; megatron-core needs the test
shim)::

    PYTHONPATH=tests/miles_megatron/cpu_shim_site:tests/miles_megatron \\
        torchrun --nproc-per-node 1 scripts/bench_memory_plan.py --shapes tiny --out m.json

Per case (``--shapes`` x ``--backends`` x ``--recompute``): a random Qwen3-shaped model written
once per shape as a HF directory (``0.6B``, ``1.7B``, ``4B``, ``8B`` or ``tiny``), one backend
built as ``miles train`` builds it (bf16 on a GPU, fp32 master weights and AdamW state,
``--use-dynamic-batch-size --max-tokens-per-gpu --tokens-per-gpu``; recompute: FSDP
``--gradient-checkpointing``, Megatron ``--recompute-granularity full --recompute-method
uniform --recompute-num-layers 1``), and ``--rollouts`` rollouts of synthetic GRPO samples with
``--micro-batches`` micro-batches per optimizer step on every rank (so the gradients of a step
exist whole, as the estimate counts them). The estimate is computed from the same flags parsed as
``miles train`` parses them (the launcher's groups too), its training and optimizer-step phases
(publishing is not run here). Measured on CUDA: ``torch.cuda.max_memory_allocated`` (and
reserved) from before the backend was built to the end of the last rollout. Prints a table of
estimate, measured and their ratio and writes JSON; asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import train_bench_model as bench  # noqa: E402  (same-directory module)

GiB = 2**30


def say(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"bench_memory_plan: {message}", flush=True)


def shape_config(name: str):
    """A Qwen3 config: the published sizes, or ``tiny`` (2 layers, hidden 64, vocabulary 512)."""
    from transformers import Qwen3Config

    if name != "tiny":
        return bench.qwen3_config(name)
    return Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
    )  # fmt: skip


def make_rollout(tokens_per_step: int, world: int, steps: int, vocab: int, longest: int):
    """Samples of ``longest / 4 .. longest`` tokens (half of each the response) filling
    ``tokens_per_step`` per rank per step, in groups of 4."""
    from miles_core.batch import RolloutBatch, Sample

    g = torch.Generator().manual_seed(0)
    samples, total = [], 0
    while total < tokens_per_step * world * steps or len(samples) % 4:
        length = int(torch.randint(longest // 4, longest + 1, (1,), generator=g))
        samples.append(
            Sample(
                tokens=torch.randint(2, vocab, (length,), generator=g),
                response_length=length // 2,
                reward=float(torch.rand((), generator=g)),
                group_index=len(samples) // 4,
            )
        )
        total += length
    return RolloutBatch(samples)


def backend_argv(name: str, hf_dir: str, args, recompute: bool, cuda: bool) -> list[str]:
    """The flags both parses share (the backend's own, and ``miles train``'s for the estimate)."""
    argv = ["--hf-checkpoint", hf_dir, "--lr", "1e-6", "--advantage-estimator", "grpo"]
    argv += ["--bf16"] if cuda else ["--no-bf16"]
    argv += ["--use-dynamic-batch-size", "--max-tokens-per-gpu", str(args.tokens_per_gpu)]
    argv += ["--num-steps-per-rollout", str(args.steps)]
    if name == "megatron":
        argv += ["--tensor-model-parallel-size", str(args.tp)]
        argv += ["--sequence-parallel"] if args.tp > 1 else []
        if recompute:
            argv += ["--recompute-granularity", "full", "--recompute-method", "uniform"]
            argv += ["--recompute-num-layers", "1"]
    elif recompute:
        argv += ["--gradient-checkpointing"]
    if not cuda:
        argv += ["--attn-implementation", "sdpa"]
    return argv


def estimate(name: str, argv: list[str], world: int, cuda: bool) -> dict:
    """The memory plan's trainer-GPU estimate of these flags, by term and phase (bytes)."""
    from miles_core.args import entry_point_groups, parse_args
    from miles_launch.memory_estimate import trainer_estimate
    from miles_launch.memory_plan import trainer_layout
    from miles_launch.model_shape import ModelShape

    hf_dir = argv[argv.index("--hf-checkpoint") + 1]
    prompts = Path(hf_dir) / "prompts.jsonl"  # the launcher's groups require one
    prompts.write_text('{"prompt": "1 + 1 ="}\n')
    launch = ["--train-backend", name, "--actor-num-gpus-per-node", str(world)]
    launch += ["--rollout-engine", "builtin", "--prompt-data", str(prompts)]
    args = parse_args([*argv, *launch], entry_point_groups("core", name, "launch"))
    layout = dataclasses.replace(trainer_layout(args, cuda), one_micro_batch=False)
    gpu, _ = trainer_estimate(ModelShape.from_hf_dir(hf_dir), layout)
    phases = {k: v for k, v in gpu.phases.items() if k != "publishing"}
    return {"terms": gpu.terms, "phases": phases, "peak": max(phases.values())}


def run_case(name: str, hf_dir: str, cfg, args, recompute: bool, cuda: bool) -> dict:
    from miles_core.args import core_groups, parse_args
    from miles_core.backends import load
    from miles_core.partition import partition_for_dp

    world = dist.get_world_size()
    argv = backend_argv(name, hf_dir, args, recompute, cuda)
    planned = estimate(name, argv, world, cuda)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    started = time.perf_counter()
    cls = load(name)
    backend = cls()
    backend.init(parse_args(argv, [*core_groups(), *cls.arg_groups()]))
    held = (torch.cuda.memory_allocated() - base) if cuda else 0
    layout = backend.data_layout()
    longest = min(2048, max(16, args.tokens_per_gpu // 2))
    rollout = make_rollout(
        args.tokens_per_gpu * args.micro_batches, layout.dp_size, args.steps,
        cfg.vocab_size, longest,
    )  # fmt: skip
    shard = partition_for_dp(rollout, layout.dp_size)[layout.dp_rank]
    for rollout_id in range(args.rollouts):
        backend.train(rollout_id, shard if layout.consumes_data else None)
    if cuda:
        torch.cuda.synchronize()
    measured = {
        "held_after_init": held,
        "max_allocated": (torch.cuda.max_memory_allocated() - base) if cuda else None,
        "max_reserved": torch.cuda.max_memory_reserved() if cuda else None,
    }
    backend.close()
    del backend
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    case = {
        "backend": name,
        "recompute": recompute,
        "tokens_per_gpu": args.tokens_per_gpu,
        "seconds": time.perf_counter() - started,
        "estimate": planned,
        "measured": measured,
        "ratio": (planned["peak"] / measured["max_allocated"]) if cuda else None,
    }
    ratio = f"{case['ratio']:.3f}" if cuda else "- (no CUDA)"
    say(f"{name} recompute={recompute}: estimate {planned['peak'] / GiB:.3f} GiB, ratio {ratio}")
    return case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["0.6B", "1.7B"],
                        choices=[*sorted(bench.QWEN3_SIZES), "tiny"])  # fmt: skip
    parser.add_argument("--backends", nargs="+", default=["fsdp", "megatron"],
                        choices=["fsdp", "megatron"])  # fmt: skip
    parser.add_argument("--recompute", nargs="+", default=["off", "on"], choices=["off", "on"])
    parser.add_argument("--tokens-per-gpu", type=int, default=8192,
                        help="--max-tokens-per-gpu (tiny: use 256)")  # fmt: skip
    parser.add_argument("--micro-batches", type=int, default=2,
                        help="micro-batches per optimizer step on each rank")  # fmt: skip
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per rollout")
    parser.add_argument("--rollouts", type=int, default=2,
                        help="rollouts trained (the first creates the AdamW state)")  # fmt: skip
    parser.add_argument("--tp", type=int, default=1, help="Megatron tensor-parallel size")
    parser.add_argument("--out", required=True, help="JSON report path")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    report = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "gpu_memory_gib": torch.cuda.get_device_properties(0).total_memory / GiB if cuda else None,
        "world": dist.get_world_size(),
        "torch": torch.__version__,
        "cases": [],
    }

    def write() -> None:
        if dist.get_rank() == 0:
            Path(args.out).write_text(json.dumps(report, indent=2))

    for shape in args.shapes:
        cfg = shape_config(shape)
        box = [tempfile.mkdtemp(prefix="bench_memory_plan_") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box)
        if dist.get_rank() == 0:
            say(f"writing a random Qwen3-{shape}-shaped model")
            bench.write_random_model(box[0], cfg)
        dist.barrier()
        for name in args.backends:
            for recompute in args.recompute:
                case = run_case(name, box[0], cfg, args, recompute == "on", cuda)
                report["cases"].append({"shape": shape, **case})
                write()

    if dist.get_rank() == 0:
        print(
            f"\n{report['device']}, {report['world']} rank(s), {args.tokens_per_gpu} tokens per "
            f"micro-batch, {args.micro_batches} micro-batches per step"
        )
        from miles_launch.memory_plan import size

        print(
            f"{'shape':6s} {'backend':9s} {'recompute':9s} {'estimate':>10s} "
            f"{'measured':>10s} {'reserved':>10s} {'ratio':>6s}"
        )
        for c in report["cases"]:
            m = c["measured"]
            alloc = size(m["max_allocated"]) if cuda else "-"
            reserved = size(m["max_reserved"]) if cuda else "-"
            ratio = f"{c['ratio']:.3f}" if cuda else "-"
            print(
                f"{c['shape']:6s} {c['backend']:9s} {str(c['recompute']):9s} "
                f"{size(c['estimate']['peak']):>10s} {alloc:>10s} {reserved:>10s} {ratio:>6s}"
            )
    write()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
