"""``--true-on-policy`` off and on, at the Qwen3-0.6B and 4B shapes on one GPU: the
train/rollout mismatch (engine vs trainer), generate seconds and train seconds.

For each shape (random bf16 weights from the config, ``train_bench_model.qwen3_config``) and
each mode, in this process: the built-in engine as ``python -m miles_launch.builtin_engine
[--true-on-policy] --device cuda`` builds it generates ``--prompts`` random prompts of
``--prompt-len`` tokens, ``--new-tokens`` each, at temperature 1 (one untimed short warm-up
generation, then the timed one); the engine is shut down; the FSDP backend (bf16, one rank)
trains that rollout, all of it in one micro-batch, one optimizer step (gradient checkpointing
unless ``--no-gradient-checkpointing``). Mode off: the job's defaults (the GPU's default
attention, the fused head, the old-log-prob forward); mode on: ``--true-on-policy`` (the
old-log-prob forward is skipped, the engine's log-probs are the old policy's; its fused head),
and on-dense (the mode with ``--no-fused-log-probs``, on the same rollout). The mismatch is
the first ``train`` call's (the weights the engine sampled with); train seconds are the median
of ``--repeats`` further calls (Triton and CUDA warmed up; each one's seconds are kept too) of
``--steps`` optimizer steps (default 2: with one, the old policy is the current one and no
old-log-prob forward runs in either mode), and of them ``old_logprob_s`` the old-policy step
(the old-log-prob forward with the mode off; taking the engine's log-probs with it on).

    uv run python scripts/bench_true_on_policy.py --out /tmp/top.json
    uv run python scripts/bench_true_on_policy.py --quick --out /tmp/top.json   # CPU, tiny

``--quick`` runs a tiny fp32 model on CPU (gloo), the CPU mode, to check the script end to end.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_bench_model import (  # noqa: E402
    print_profile,
    profile_rollout,
    qwen3_config,
    sync_sites,
    write_random_model,
)

TEMPERATURE = 1.0


def tiny_config():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    )  # fmt: skip


def write_tiny_model(path: str) -> None:
    """fp32 (the CPU mode's dtype) random tiny model and a two-token tokenizer."""
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.float32).save_pretrained(path)
    tok = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "<eos>": 1}, unk_token="<unk>"))
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>"
    ).save_pretrained(path)


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def generate(state, prompts: list[list[int]], new_tokens: int, seed: int):
    """Submit all prompts together; (requests, seconds until the last is done)."""
    from miles_launch.builtin_engine.request import Request
    from miles_launch.builtin_engine.sampling import SamplingParams

    done = threading.Semaphore(0)
    reqs = [
        Request(
            rid=f"{seed}-{i}",
            prompt_ids=p,
            params=SamplingParams(
                max_new_tokens=new_tokens,
                temperature=TEMPERATURE,
                ignore_eos=True,
                sampling_seed=seed * 1000 + i,
            ),  # fmt: skip
            on_done=lambda r: done.release(),
        )
        for i, p in enumerate(prompts)
    ]
    t0 = time.perf_counter()
    state.scheduler.submit(reqs)
    for _ in reqs:
        if not done.acquire(timeout=600):
            raise RuntimeError("generation did not finish in 600 s")
    seconds = time.perf_counter() - t0
    for r in reqs:
        if r.finish_reason is None or r.finish_reason["type"] != "length":
            raise RuntimeError(f"request {r.rid} ended with {r.finish_reason}")
    return reqs, seconds


def engine_rollout(hf_dir: str, device: str, on: bool, prompts, new_tokens: int):
    """(RolloutBatch, generate seconds) from the built-in engine of this mode."""
    from miles_core.batch import RolloutBatch, Sample
    from miles_launch.builtin_engine.__main__ import build_state, parse_args

    flags = ["--model-path", hf_dir, "--device", device] + (["--true-on-policy"] if on else [])
    state = build_state(parse_args(flags))
    try:
        generate(state, prompts, min(16, new_tokens), seed=0)  # warm-up
        reqs, seconds = generate(state, prompts, new_tokens, seed=1)
    finally:
        state.scheduler.shutdown()
        del state
        gc.collect()
        if device != "cpu":
            torch.cuda.empty_cache()
    samples = [
        Sample(
            tokens=torch.tensor(r.prompt_ids + r.output_ids),
            response_length=len(r.output_ids),
            reward=float(i % 2),
            rollout_log_probs=torch.tensor(r.output_logprobs),
        )
        for i, r in enumerate(reqs)
    ]
    return RolloutBatch(samples), seconds


def train(
    hf_dir: str,
    device: str,
    on: bool,
    batch,
    checkpointing: bool,
    steps: int,
    repeats: int,
    dense_head: bool = False,
    profile: bool = False,
):
    """(first train call's metrics, the next ``repeats`` calls' seconds, the old-policy step's
    seconds of each, the backend's attention, and with ``profile`` one more timed rollout's
    profile (:func:`train_bench_model.profile_rollout`)) on a fresh FSDP backend."""
    from miles_core.args import core_groups, parse_args
    from miles_fsdp import train_step
    from miles_fsdp.args import fsdp_groups
    from miles_fsdp.backend import FSDPBackend

    old_policy_s: list[float] = []
    profiled = None
    real = train_step._with_policy_log_probs

    def timed(ctx, b):
        _sync(device)
        t0 = time.perf_counter()
        out = real(ctx, b)
        _sync(device)
        old_policy_s.append(time.perf_counter() - t0)
        return out

    tokens = sum(len(s.tokens) for s in batch)
    argv = [
        "--hf-checkpoint", hf_dir, "--lr", "1e-6", "--advantage-estimator", "grpo",
        "--num-steps-per-rollout", "1", "--use-dynamic-batch-size",
        "--max-tokens-per-gpu", str(tokens), "--rollout-temperature", str(TEMPERATURE),
        "--fsdp-compute-dtype", "fp32" if device == "cpu" else "bf16",
    ]  # fmt: skip
    if on:
        argv.append("--true-on-policy")
    if checkpointing:
        argv.append("--gradient-checkpointing")
    if dense_head:
        argv.append("--no-fused-log-probs")
    backend = FSDPBackend()
    backend.init(parse_args(argv, [*core_groups(), *fsdp_groups()]))
    backend_attn = backend.attn_implementation
    train_step._with_policy_log_probs = timed
    try:
        metrics = backend.train(0, batch)  # one step: the weights the engine sampled with
        # the timed rollout: ``steps`` optimizer steps, where the mode off needs the old-log-prob
        # forward (with one step the old policy is the current one, and no forward runs)
        backend.args.num_steps_per_rollout = steps
        backend.args.run_config = backend.args.run_config.rebuilt(backend.args)
        seconds = []
        for rollout in range(1, repeats + 1):
            _sync(device)
            t0 = time.perf_counter()
            backend.train(rollout, batch)
            _sync(device)
            seconds.append(time.perf_counter() - t0)
        if profile:
            profiled = profile_rollout(functools.partial(backend.train, repeats + 1, batch))
            if device != "cpu":  # where the host waits for the GPU (one more rollout)
                profiled["sync_sites"] = sync_sites(
                    functools.partial(backend.train, repeats + 2, batch)
                )
    finally:
        train_step._with_policy_log_probs = real
        backend.close()
        del backend
        gc.collect()
        if device != "cpu":
            torch.cuda.empty_cache()
    return metrics, seconds, old_policy_s[1 : repeats + 1], backend_attn, profiled


#: The rows ``--modes`` may name.
MODES = ("off", "on", "on-dense")


def init_group(device: str) -> None:
    init = Path(tempfile.mkdtemp(prefix="bench_top_pg_")) / "init"
    os.environ.setdefault("LOCAL_RANK", "0")
    if device != "cpu":
        torch.cuda.set_device(0)
    backend = "gloo" if device == "cpu" else "nccl"
    dist.init_process_group(backend, init_method=f"file://{init}", rank=0, world_size=1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="0.6B,4B", help="comma-separated Qwen3 shapes")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64, help="tokens of the longest prompt")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the trainer recomputes each layer in the backward (both modes; default on)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=2,
        help="optimizer steps of the timed rollout (> 1: the mode off runs the old-log-prob "
        "forward; the mismatch is measured on a one-step rollout before)",
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="timed rollouts per row (the median is reported)"
    )
    p.add_argument(
        "--modes",
        default="off,on,on-dense",
        help="comma-separated rows per shape: off, on (the mode's fused head), on-dense (the "
        "mode with --no-fused-log-probs: the materialised logits; it trains the on row's rollout)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile one more timed rollout per row (GPU busy and idle time, kernel time by "
        "category, the host's waits for the GPU), then one more with CUDA sync debugging (the "
        "code sites where the host waits), into the JSON",
    )
    p.add_argument("--quick", action="store_true", help="tiny fp32 model on CPU (a smoke run)")
    p.add_argument("--out", required=True, help="JSON file of the results")
    args = p.parse_args(argv)
    from miles_core import mismatch

    device = "cpu" if args.quick else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device (use --quick for the CPU smoke run)")
    if args.quick and args.profile:
        p.error("--profile needs a GPU (not with --quick)")
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES):
        p.error(f"--modes: {args.modes!r} (choose from {', '.join(MODES)})")
    if args.quick:
        args.sizes, args.prompts, args.prompt_len, args.new_tokens = "tiny", 3, 12, 8
    init_group(device)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for size in args.sizes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"bench_top_{size}_") as hf_dir:
            if args.quick:
                write_tiny_model(hf_dir)
                vocab = tiny_config().vocab_size
            else:
                config = qwen3_config(size)
                write_random_model(hf_dir, config)
                vocab = config.vocab_size
            # prompts of different lengths (left padding in the engine's prefill)
            half = max(1, args.prompt_len // 2)
            lengths = [args.prompt_len - (7 * i) % half for i in range(args.prompts)]
            prompts = [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]
            rollouts: dict[bool, tuple] = {}  # the engine's rollout per engine mode
            for mode in modes:
                on = mode != "off"
                try:
                    if on not in rollouts:
                        rollouts[on] = engine_rollout(hf_dir, device, on, prompts, args.new_tokens)
                    batch, gen_s = rollouts[on]
                    metrics, train_s, old_s, attn, profiled = train(
                        hf_dir,
                        device,
                        on,
                        batch,
                        args.gradient_checkpointing,
                        args.steps,
                        args.repeats,
                        dense_head=mode == "on-dense",
                        profile=args.profile,
                    )
                except torch.cuda.OutOfMemoryError as exc:  # this row only; the others go on
                    print(f"{size} {mode}: CUDA out of memory: {exc}", flush=True)
                    rows.append(
                        dict(size=size, mode=mode, true_on_policy=on, error="out of memory")
                    )
                    gc.collect()
                    torch.cuda.empty_cache()
                    continue
                rows.append(
                    dict(
                        size=size, mode=mode, true_on_policy=on, device=device,
                        abs_diff_mean=metrics.get(mismatch.ABS_DIFF),
                        abs_diff_max=metrics.get(mismatch.ABS_DIFF_MAX),
                        generate_s=round(gen_s, 3), train_s=round(statistics.median(train_s), 3),
                        train_s_each=[round(t, 3) for t in train_s],
                        old_logprob_s=round(statistics.median(old_s), 3), attention=attn,
                        train_tokens=sum(len(x.tokens) for x in batch),
                        steps=args.steps, prompts=args.prompts, prompt_len=args.prompt_len,
                        new_tokens=args.new_tokens, profile=profiled,
                    )
                )  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    dist.destroy_process_group()
    meta = dict(
        torch=torch.__version__,
        gpu=torch.cuda.get_device_name(0) if device == "cuda" else None,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    head = (
        f"{'size':>6} {'mode':>8} {'mean|dlogp|':>12} {'max|dlogp|':>11} {'gen s':>7} "
        f"{'train s':>8} {'of it old-lp s':>14} {'tokens':>7}  attention"
    )
    print(head)
    for r in rows:
        if "error" in r:
            print(f"{r['size']:>6} {r['mode']:>8}  {r['error']}")
            continue
        mean, worst = r["abs_diff_mean"], r["abs_diff_max"]
        print(
            f"{r['size']:>6} {r['mode']:>8} "
            f"{mean if mean is None else f'{mean:.3g}':>12} "
            f"{worst if worst is None else f'{worst:.3g}':>11} "
            f"{r['generate_s']:>7.2f} {r['train_s']:>8.3f} {r['old_logprob_s']:>14.3f} "
            f"{r['train_tokens']:>7}  {r['attention']}"
        )
    for r in rows:
        if r.get("profile"):
            print_profile(f"Qwen3-{r['size']} true on-policy {r['mode']}", r["profile"])


if __name__ == "__main__":
    main()
