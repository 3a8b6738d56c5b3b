"""Time the batch-invariant GPU kernels of ``--true-on-policy`` against the kernels the trainer
runs without the mode, measured in the same run: the matmul kernel against cuBLAS (``F.linear``)
at a Qwen3 shape's projections and output head, and the attention kernel over one packed row
against torch's varlen flash attention. Prints a table and writes JSON.

    uv run python scripts/bench_batch_invariant_kernels.py --out /tmp/bik.json

``--matmul-configs`` times other fixed tilings of the bf16 matmul beside the one the mode uses
(``BLOCK_M,BLOCK_N,BLOCK_K,warps,stages`` each; a tiling fixes a row's arithmetic, so the
mode keeps one, chosen from such a run; a tiling that does not compile or fit is reported as
such).

Defaults are the Qwen3-4B shape (hidden 2,560, MLP 9,728, 32 heads over 8 key-value heads of
128, vocabulary 151,936) and a row of 32 samples of 304-310 tokens. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def _seconds(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2560)
    p.add_argument("--outputs", default="9728,4096,151936", help="comma-separated N of the matmuls")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--sample-len", type=int, default=304)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument(
        "--matmul-configs",
        nargs="*",
        default=[],
        metavar="BM,BN,BK,WARPS,STAGES",
        help="more bf16 matmul tilings to time beside the mode's",
    )
    p.add_argument("--out", required=True, help="JSON file of the results")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    from miles_core.batch_invariant import packed_spans
    from miles_core.varlen_attention import varlen_causal_attention
    from miles_native.kernels import batch_invariant as kernels

    bf16, dev = torch.bfloat16, "cuda"
    lens = [args.sample_len + i % 7 for i in range(args.samples)]
    tokens = sum(lens)
    rows = []
    x = torch.randn(tokens, args.hidden, device=dev, dtype=bf16)
    mode_config = kernels.MATMUL_CONFIGS[bf16]
    configs = [mode_config, *(tuple(int(v) for v in c.split(",")) for c in args.matmul_configs)]
    for n in (int(v) for v in args.outputs.split(",")):
        w = torch.randn(n, args.hidden, device=dev, dtype=bf16)
        base = _seconds(lambda w=w: F.linear(x, w), args.iters)
        flop = 2 * tokens * args.hidden * n
        for config in configs:
            kernels.MATMUL_CONFIGS[bf16] = config
            try:
                mine = _seconds(lambda w=w: kernels.linear_forward(x, w), args.iters)
            except Exception as exc:  # a tiling that does not compile or fit shared memory
                print(f"linear N={n} tiling {config}: {type(exc).__name__}: {exc}"[:300])
                continue
            finally:
                kernels.MATMUL_CONFIGS[bf16] = mode_config
            tiling = "the mode's" if config == mode_config else ",".join(map(str, config))
            rows.append(dict(op=f"linear {tokens}x{args.hidden}x{n} ({tiling})", tiling=config,
                             kernel_ms=mine * 1e3, baseline="cuBLAS", baseline_ms=base * 1e3,
                             ratio=base / mine, kernel_tflops=flop / mine / 1e12,
                             baseline_tflops=flop / base / 1e12))  # fmt: skip
        del w
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    q = torch.randn(1, args.heads, tokens, args.head_dim, device=dev, dtype=bf16)
    kv = torch.randn(1, args.kv_heads, tokens, args.head_dim, device=dev, dtype=bf16)
    start, end = packed_spans(cu, tokens)
    scale = args.head_dim**-0.5
    mine = _seconds(lambda: kernels.attention_forward(q, kv, kv, start, end, scale), args.iters)
    qt, kt = q[0].transpose(0, 1).contiguous(), kv[0].transpose(0, 1).contiguous()
    base = _seconds(lambda: varlen_causal_attention(qt, kt, kt, cu, max(lens), scale), args.iters)
    rows.append(dict(op=f"attention {args.samples} samples, {tokens} tokens", kernel_ms=mine * 1e3,
                     baseline="varlen flash", baseline_ms=base * 1e3, ratio=base / mine))  # fmt: skip
    meta = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(0),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))  # fmt: skip
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"{'op':<58} {'kernel ms':>10} {'baseline':>13} {'base ms':>8} {'base/kernel':>11}")
    for r in rows:
        print(f"{r['op']:<58} {r['kernel_ms']:>10.3f} {r['baseline']:>13} "
              f"{r['baseline_ms']:>8.3f} {r['ratio']:>11.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
