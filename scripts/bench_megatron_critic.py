"""Benchmark: what the Megatron critic (``--use-critic``, PPO) adds to a rollout's training.

    torchrun --nproc-per-node 1 scripts/bench_megatron_critic.py --size 1.7B --out critic.json
    torchrun --nproc-per-node 2 scripts/bench_megatron_critic.py --size 1.7B --tp 2 --out c2.json

One random Qwen3-shaped model (``--size``, or ``--shape HIDDEN,INTERMEDIATE,LAYERS,HEADS`` for
a small one, vocabulary ``--vocab``) and one synthetic rollout (``--tokens-per-gpu`` tokens per
GPU per optimizer step). Baseline, same run, same rollout: the actor alone under GRPO
(``train``). Then PPO as a trainer rank runs it: the critic's ``compute_values`` (no-grad
forward), the critic's ``train`` (value loss) and the actor's ``train`` on the GAE advantages of
those values. Reported: median seconds per rollout of each phase after ``--warmup`` rollouts,
PPO / GRPO, and on CUDA the peak memory. On a host without GPUs it runs on gloo ranks (for
megatron-core, with ``tests/miles_megatron/cpu_shim_site`` on ``PYTHONPATH``) in fp32. Prints a
table and writes JSON; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import train_bench_model as bench  # noqa: E402  (same-directory module)


def _config(args):
    from transformers import Qwen3Config

    if args.shape is None:
        return bench.qwen3_config(args.size or "1.7B")
    hidden, intermediate, layers, heads = (int(x) for x in args.shape.split(","))
    return Qwen3Config(
        vocab_size=args.vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=hidden // heads, max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip


def _rollout(args, vocab: int, dp: int):
    """Samples of 64..256 tokens (half response), ~tokens-per-gpu per DP rank per step."""
    from miles_core.batch import RolloutBatch, Sample

    g = torch.Generator().manual_seed(1)
    samples, total = [], 0
    while total < args.tokens_per_gpu * dp * args.steps or len(samples) % 4:
        length = int(torch.randint(64, 257, (1,), generator=g))
        tokens = torch.randint(2, vocab, (length,), generator=g)
        reward = float(torch.rand((), generator=g))
        samples.append(Sample(tokens, length // 2, reward, group_index=len(samples) // 4))
        total += length
    return RolloutBatch(samples)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn):
    _sync()
    start = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--shape", default=None, help="HIDDEN,INTERMEDIATE,LAYERS,HEADS")
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary with --shape")
    bench.add_timing_flags(parser)
    parser.add_argument("--out", default="bench_megatron_critic.json")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = _config(args)
    box = [tempfile.mkdtemp(prefix="bench_critic_") if rank == 0 else None]
    dist.broadcast_object_list(box)
    if rank == 0:
        bench.write_random_model(box[0], cfg)
    dist.barrier()
    from miles_core.args import core_groups, parse_args
    from miles_core.partition import partition_for_dp
    from miles_megatron.args import megatron_groups
    from miles_megatron.backend import MegatronBackend

    dp = world // args.tp
    shard = partition_for_dp(_rollout(args, cfg.vocab_size, dp), dp, keep_groups=True)[
        rank // args.tp
    ]
    argv = ["--hf-checkpoint", box[0], "--lr", "1e-6"]
    argv += ["--use-dynamic-batch-size", "--max-tokens-per-gpu", str(args.tokens_per_gpu)]
    argv += ["--num-steps-per-rollout", str(args.steps), "--tensor-model-parallel-size"]
    argv += [str(args.tp)] + (["--sequence-parallel"] if args.tp > 1 else [])
    argv += ["--bf16"] if cuda else ["--no-bf16"]
    groups = [*core_groups(), *megatron_groups()]
    phases: dict[str, list[float]] = {}
    peaks: dict[str, float] = {}

    def record(name: str, seconds: float, rollout: int) -> None:
        if rollout >= args.warmup:
            phases.setdefault(name, []).append(seconds)

    actor = MegatronBackend()
    actor.init(parse_args([*argv, "--advantage-estimator", "grpo"], groups))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for r in range(args.warmup + args.iters):
        record("grpo: actor train", _timed(lambda r=r: actor.train(r, shard))[1], r)
    peaks["grpo"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    actor.close()
    ppo_args = parse_args(
        [*argv, "--advantage-estimator", "ppo", "--use-critic"], groups
    )  # critic lr = --lr
    critic, actor = MegatronBackend(), MegatronBackend()
    critic.init(ppo_args, "critic")
    actor.init(ppo_args, "actor")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for r in range(args.warmup + args.iters):
        values, t_values = _timed(lambda: critic.compute_values(shard))
        batch = shard.with_fields(values=values)
        record("ppo: critic values", t_values, r)
        record("ppo: critic train", _timed(lambda r=r, b=batch: critic.train(r, b))[1], r)
        record("ppo: actor train", _timed(lambda r=r, b=batch: actor.train(r, b))[1], r)
    peaks["ppo"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    critic.close()
    actor.close()
    if rank == 0:
        medians = {k: statistics.median(v) for k, v in phases.items()}
        ppo = sum(v for k, v in medians.items() if k.startswith("ppo"))
        grpo = medians["grpo: actor train"]
        print(f"{'phase':22s} {'s/rollout':>10s}  (world {world}, tp {args.tp})")
        for name, seconds in medians.items():
            print(f"{name:22s} {seconds:10.3f}")
        print(f"{'ppo total / grpo':22s} {ppo / grpo:10.2f}x   peak GiB {peaks}")
        result = {"world": world, "tp": args.tp, "shape": args.shape or args.size or "1.7B"}
        result |= {"tokens": shard.total_tokens, "median_s": medians, "peak_gib": peaks}
        Path(args.out).write_text(json.dumps({**result, "ppo_over_grpo": ppo / grpo}, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
