"""Benchmark the fused MoE Triton kernels on one Qwen3-30B-A3B-shaped expert layer.

Layer: 128 experts, top-8, hidden 2048, expert intermediate 768, bf16, routing from a random
router (softmax, top-k, renormalized as Qwen3-MoE does). For each token count, forward and
forward+backward (grads of hidden states, both expert weights and the routing weights) are
timed for:

* ``fused``: ``miles_native.kernels.fused_experts``;
* ``eager``: transformers' ``Qwen3MoeExperts`` with its eager per-expert loop;
* ``grouped_mm``: transformers' ``grouped_mm`` experts implementation, where it runs.

TFLOP/s count the expert GEMMs only (forward ``6 S H I``, forward+backward ``18 S H I`` with
``S = tokens * top_k``) and are compared with the bf16 matmul peak measured in the same run
(an 8192^3 ``torch.matmul``). Prints a table and writes JSON to ``--out``. GPU only.

Usage::

    python scripts/bench_fused_moe.py --out bench_fused_moe.json
    python scripts/bench_fused_moe.py --tokens 16384 --baselines eager
"""

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import train_bench_model as bench  # noqa: E402  (same-directory module)


def time_ms(fn, warmup: int, iters: int) -> float:
    """Median wall time of ``fn`` in ms, measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def build_experts(args, implementation: str):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(
        hidden_size=args.hidden,
        moe_intermediate_size=args.intermediate,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
    )
    config._experts_implementation = implementation
    experts = Qwen3MoeExperts(config).to(device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.02, generator=gen)
        experts.down_proj.normal_(0, 0.02, generator=gen)
    return experts


def make_batch(args, num_tokens):
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, args.hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(num_tokens, args.experts, device="cuda", generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), args.top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)
    dy = torch.randn_like(x)
    return x, ids, weights, dy


def runner(name, experts, x, ids, weights, dy):
    """(forward, forward+backward) closures for one implementation."""
    from miles_native.kernels import fused_experts

    xg = x.detach().requires_grad_()
    wg = weights.detach().requires_grad_()

    if name == "fused":

        def forward():
            return fused_experts(xg, experts.gate_up_proj, experts.down_proj, ids, wg)
    else:

        def forward():
            return experts(xg, ids, wg)

    def forward_backward():
        xg.grad = wg.grad = None
        experts.zero_grad(set_to_none=True)
        forward().backward(dy)

    def forward_only():
        with torch.no_grad():
            return forward()

    return forward_only, forward_backward, forward


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--baselines", nargs="*", default=["eager", "grouped_mm"])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default="bench_fused_moe.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")

    peak = bench.measure_bf16_peak_tflops()
    modules = {"fused": build_experts(args, "eager")}
    for name in args.baselines:
        modules[name] = build_experts(args, name)
        modules[name].load_state_dict(modules["fused"].state_dict())
    rows = []
    for num_tokens in args.tokens:
        x, ids, weights, dy = make_batch(args, num_tokens)
        flops_fwd = 6 * num_tokens * args.top_k * args.hidden * args.intermediate
        reference = None
        for name, experts in modules.items():
            row = {"impl": name, "tokens": num_tokens}
            try:
                fwd, fwd_bwd, raw = runner(name, experts, x, ids, weights, dy)
                with torch.no_grad():
                    out = raw().float()
                if name == "fused":
                    reference = out
                else:
                    row["rel_diff_vs_fused"] = ((out - reference).norm() / reference.norm()).item()
                iters = args.iters if name == "fused" else max(2, args.iters // 3)
                row["fwd_ms"] = time_ms(fwd, warmup=2, iters=iters)
                row["fwd_bwd_ms"] = time_ms(fwd_bwd, warmup=2, iters=iters)
                row["fwd_tflops"] = flops_fwd / row["fwd_ms"] / 1e9
                row["fwd_bwd_tflops"] = 3 * flops_fwd / row["fwd_bwd_ms"] / 1e9
            except Exception as err:  # noqa: BLE001 - a baseline may not run on this stack
                row["error"] = f"{type(err).__name__}: {err}"[:200]
            rows.append(row)
            torch.cuda.empty_cache()
    for row in rows:
        fused = next(r for r in rows if r["impl"] == "fused" and r["tokens"] == row["tokens"])
        if "fwd_ms" in row and "fwd_ms" in fused:
            row["fused_speedup_fwd"] = row["fwd_ms"] / fused["fwd_ms"]
            row["fused_speedup_fwd_bwd"] = row["fwd_bwd_ms"] / fused["fwd_bwd_ms"]
            row["fwd_bwd_pct_of_peak"] = 100 * row["fwd_bwd_tflops"] / peak

    header = f"{'impl':<11}{'tokens':>7}{'fwd ms':>10}{'fwd+bwd ms':>12}{'TFLOP/s':>9}"
    header += f"{'% peak':>8}{'fused x':>9}"
    print(f"{torch.cuda.get_device_name()}: bf16 matmul peak {peak:.0f} TFLOP/s (measured)")
    print(header)
    for row in rows:
        if "error" in row:
            print(f"{row['impl']:<11}{row['tokens']:>7}  {row['error']}")
            continue
        print(
            f"{row['impl']:<11}{row['tokens']:>7}{row['fwd_ms']:>10.2f}{row['fwd_bwd_ms']:>12.2f}"
            f"{row['fwd_bwd_tflops']:>9.0f}{row['fwd_bwd_pct_of_peak']:>7.0f}%"
            f"{row['fused_speedup_fwd_bwd']:>8.1f}x"
        )
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "shape": {k: getattr(args, k) for k in ("experts", "top_k", "hidden", "intermediate")},
        "matmul_peak_tflops": peak,
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
