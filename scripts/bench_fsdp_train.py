"""Benchmark: FSDPBackend.train vs a plain, strong FSDP2 loop, in one run.

    torchrun --nproc-per-node 1 scripts/bench_fsdp_train.py --out bench_fsdp_1gpu.json
    torchrun --nproc-per-node 2 scripts/bench_fsdp_train.py --out bench_fsdp_2gpu.json

Both sides train the same Qwen3-0.6B-shaped random model (written once as a HF directory) on the
same synthetic rollouts (~``--tokens-per-gpu`` tokens per GPU per optimizer step, THD-packed by
miles-core), bf16 compute / fp32 master and reduction, the same attention implementation.
``--compile-decoder-layers`` times the backend a second time in the same run with that flag (its
own row, and its ratio to the eager backend); ``--use-rollout-logprobs`` drops the old-log-prob
forward on both sides.
The plain loop is built the strong way: ``fully_shard`` per decoder layer and the root,
``MixedPrecisionPolicy(bf16, fp32)``, fused AdamW, packed rows with ``packed_attention_kwargs``,
a policy-gradient loss on token log-probs. Reported per side: tokens/s per GPU, MFU (model FLOPs
``6 N + 6 L d s`` per token against ``--peak-tflops``), peak memory. Prints a table and writes
JSON; it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import train_bench_model as bench  # noqa: E402  (same-directory module)

PROFILES: dict[str, dict] = {}  # side -> bench.profile_rollout's summary (--profile)
COMPILED = "miles-fsdp compiled"  # the --compile-decoder-layers row


def say(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"bench_fsdp_train: {message}", flush=True)


def run_backend(hf_dir, shard, args, world, label="miles-fsdp", flags=()):
    """Time ``FSDPBackend.train`` (``flags`` after the benchmark's own); returns the times and
    the attention implementation."""
    extra = ["--attn-implementation", args.attn] if args.attn else []
    if args.use_rollout_logprobs:
        extra.append("--use-rollout-logprobs")
    backend = bench.fsdp_backend(
        hf_dir,
        args.tokens_per_gpu,
        args.steps,
        args.gradient_checkpointing,
        [*extra, *args.backend_flags.split(), *flags],
    )
    total = args.warmup + args.iters

    def report(rollout: int, seconds: float) -> None:
        say(f"{label}: rollout {rollout + 1}/{total} {seconds:.3f} s")

    times = bench.time_train(backend, shard, args.warmup, args.iters, report=report)
    if args.profile:
        PROFILES[label] = bench.profile_rollout(lambda: backend.train(total, shard))
        PROFILES[label]["sync_sites"] = bench.sync_sites(lambda: backend.train(total + 1, shard))
    from miles_core.compiled_layers import coverage

    if compiled := coverage(backend.model):  # --compile-decoder-layers: did the layers run it?
        say(f"{label}: {compiled}")
    attn = backend.attn_implementation
    backend.close()
    return times, attn


def run_plain(hf_dir, shard, args, attn):
    """The strong hand-written FSDP2 loop, doing the same RL work as the backend: with more than
    one step per rollout, a no-grad pass for the old log-probs first, then per step the clipped
    PPO loss on the micro-batches (their count agreed over ranks, as FSDP's collectives need)."""
    from miles_core.log_probs import token_log_probs
    from miles_core.losses import ppo_clip_loss
    from miles_core.micro_batch import (
        agree_num_micro_batches,
        count_micro_batches,
        make_micro_batches,
        split_steps,
    )
    from miles_core.packing import pack_thd, packed_attention_kwargs
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda", torch.cuda.current_device())
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    cpu_group = dist.new_group(backend="gloo")
    model = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation=attn
    ).to(device)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # from_pretrained returns the model in eval mode, where HF skips gradient checkpointing:
    # the loop would then keep every activation and skip the recompute the backend pays for
    model.train()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    rewards = torch.tensor([s.reward for s in shard])

    def micro_batches(batch):
        local = count_micro_batches(batch, args.tokens_per_gpu)
        num = agree_num_micro_batches(local, group=cpu_group)
        return make_micro_batches(batch, args.tokens_per_gpu, num=num)

    def log_probs(mb):
        packed = pack_thd(mb).to(device)
        kwargs = packed_attention_kwargs(packed, attn, dtype=torch.bfloat16)
        logits = model(input_ids=packed.input_ids, **kwargs).logits
        return token_log_probs(logits, packed.targets), packed

    def one_rollout():
        steps = split_steps(shard, args.steps, cpu_group)
        old = {}  # --use-rollout-logprobs: no old-log-prob pass, as the backend skips it
        if args.steps > 1 and not args.use_rollout_logprobs:
            with torch.no_grad():
                for step_index, step in enumerate(steps):
                    old[step_index] = [log_probs(mb)[0] for mb in micro_batches(step)]
        for step_index, step in enumerate(steps):
            optimizer.zero_grad(set_to_none=True)
            n_tokens = step.num_loss_tokens
            for mb_index, mb in enumerate(micro_batches(step)):
                logp, packed = log_probs(mb)
                base = old[step_index][mb_index] if old else logp.detach()
                adv = (rewards.mean() - 0.5).to(device).expand_as(logp)
                loss, _, _ = ppo_clip_loss(logp - base, adv, 0.2)
                loss = (loss * packed.loss_mask).sum() / n_tokens
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()

    times = []
    for it in range(args.warmup + args.iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        one_rollout()
        torch.cuda.synchronize()
        if it >= args.warmup:
            times.append(time.perf_counter() - t0)
        say(
            f"plain loop: rollout {it + 1}/{args.warmup + args.iters} {time.perf_counter() - t0:.3f} s"
        )
    if args.profile:
        PROFILES["plain FSDP2 loop"] = bench.profile_rollout(one_rollout)
        PROFILES["plain FSDP2 loop"]["sync_sites"] = bench.sync_sites(one_rollout)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_timing_flags(parser)
    parser.add_argument(
        "--attn", default=None, help="attention implementation (default: backend's)"
    )
    parser.add_argument(
        "--sides",
        nargs="+",
        default=["miles", "plain"],
        choices=["miles", "plain"],
        help="which loops to time (the plain loop's dense log-probs need more memory)",
    )
    parser.add_argument("--backend-flags", default="", help="more miles flags for the backend")
    parser.add_argument(
        "--use-rollout-logprobs",
        action="store_true",
        help="the old policy is the samples' engine log-probs: the backend gets "
        "--use-rollout-logprobs and the plain loop skips its old-log-prob pass too",
    )
    parser.add_argument(
        "--compile-decoder-layers",
        action="store_true",
        help="time miles-fsdp twice in this run, without and with --compile-decoder-layers "
        "(the untimed --warmup rollouts include the compilation)",
    )
    parser.add_argument("--out", default="bench_fsdp_train.json")
    args = parser.parse_args()

    rank, world = bench.init_nccl()
    size = args.size or "0.6B"
    peak = bench.peak_tflops(args)
    say(f"Qwen3-{size} shape; bf16 matmul peak {peak:.0f} TFLOP/s (the MFU denominator)")
    cfg = bench.qwen3_config(size)
    hf_dir = bench.shared_model_dir(cfg, prefix="bench_fsdp_")

    from miles_core.partition import partition_for_dp

    rollout = bench.make_rollout(args.tokens_per_gpu, world, args.steps, seed=1)
    shard = partition_for_dp(rollout, world)[rank]
    tokens = shard.total_tokens
    seq_len = statistics.mean(shard.total_lengths)

    say(
        f"{world} GPU(s): {tokens} tokens on rank 0 per rollout; timing miles-fsdp, then the plain loop"
    )
    results = {}
    torch.cuda.reset_peak_memory_stats()
    attn = None
    variants = [("miles-fsdp", ())]
    if args.compile_decoder_layers:
        variants.append((COMPILED, ("--compile-decoder-layers",)))
    for label, flags in variants if "miles" in args.sides else ():
        times, attn = run_backend(hf_dir, shard, args, world, label, flags)
        results[label] = (times, torch.cuda.max_memory_allocated())
        say(f"{label} attention: {attn}")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if "plain" in args.sides:
        if attn is None:
            from miles_fsdp.loading import resolve_attn_implementation

            attn = resolve_attn_implementation(args.attn)
        results["plain FSDP2 loop"] = (
            run_plain(hf_dir, shard, args, attn),
            torch.cuda.max_memory_allocated(),
        )

    rows = {}
    for name, (times, peak_bytes) in results.items():
        tps = tokens / statistics.median(times)
        rows[name] = {
            "tokens_per_s_per_gpu": tps,
            "mfu": tps * bench.flops_per_token(cfg, seq_len) / (args.peak_tflops * 1e12),
            "peak_memory_gb": peak_bytes / 2**30,
            "seconds_per_rollout": statistics.median(times),
        }
    ratio = compiled_ratio = None
    if "miles-fsdp" in rows and "plain FSDP2 loop" in rows:
        ratio = (
            rows["miles-fsdp"]["tokens_per_s_per_gpu"]
            / rows["plain FSDP2 loop"]["tokens_per_s_per_gpu"]
        )
    if "miles-fsdp" in rows and COMPILED in rows:
        compiled_ratio = (
            rows[COMPILED]["tokens_per_s_per_gpu"] / rows["miles-fsdp"]["tokens_per_s_per_gpu"]
        )
    if rank == 0:
        print(
            f"\n{world} GPU(s), {torch.cuda.get_device_name()}, Qwen3-{size} shape, attn={attn}, "
            f"gradient checkpointing {args.gradient_checkpointing}, peak {peak:.0f} TFLOP/s, "
            f"{tokens} tokens/GPU/rollout, {args.steps} steps/rollout"
        )
        print(f"{'':20s} {'tok/s/GPU':>12s} {'MFU':>7s} {'peak GB':>8s}")
        for name, r in rows.items():
            print(
                f"{name:20s} {r['tokens_per_s_per_gpu']:12.0f} {r['mfu']:7.1%} {r['peak_memory_gb']:8.2f}"
            )
        if ratio is not None:
            print(f"ratio miles-fsdp / plain: {ratio:.3f} (target >= 0.95)")
        if compiled_ratio is not None:
            print(f"ratio {COMPILED} / miles-fsdp: {compiled_ratio:.3f}")
        for side, prof in PROFILES.items():
            bench.print_profile(side, prof)
        report = {
            "gpus": world,
            "device": torch.cuda.get_device_name(),
            "attn_implementation": attn,
            "size": size,
            "gradient_checkpointing": args.gradient_checkpointing,
            "bf16_peak_tflops_measured": peak,
            "tokens_per_gpu_per_rollout": tokens,
            "steps_per_rollout": args.steps,
            "use_rollout_logprobs": args.use_rollout_logprobs,
            "results": rows,
            "ratio": ratio,
            "compiled_ratio": compiled_ratio,
            "profiles": PROFILES,
            "torch": torch.__version__,
        }
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
