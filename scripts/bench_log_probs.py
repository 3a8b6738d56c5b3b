"""Peak memory and time of the log-prob (+ entropy) head, fused against dense, in the same run.

    uv run python scripts/bench_log_probs.py --out bench_log_probs.json                  # CPU
    uv run python scripts/bench_log_probs.py --device cuda --dtype bf16 --tokens 16384 65536

One forward + backward of ``sum(a * log_prob + b * entropy)`` from hidden states ``[T, H]`` and
an output projection ``[V, H]`` (V = 151,936, Qwen3's vocabulary):

* dense: ``logits = h @ W.T`` then :func:`miles_core.log_prob_head.dense_log_probs` (the
  ``--no-fused-log-probs`` path: ``[T, V]`` logits, float32 log-softmax, entropy with a graph);
* fused: :func:`miles_core.log_prob_head.fused_log_probs` (the default path).

Each case runs in its own subprocess. Peak extra memory is the peak over the forward + backward
minus the memory held once the inputs exist: on CPU the process's peak RSS
(``ru_maxrss``), on CUDA ``torch.cuda.max_memory_allocated``. It includes the gradients of
``h`` and ``W`` (the same in both paths; reported separately). A case that runs out of memory is
reported as such. Prints a table and writes JSON (``--out``). Not a timed assertion.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

import torch

VOCAB = 151_936
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_case(path: str, tokens: int, hidden: int, dtype: str, device: str, repeats: int) -> dict:
    """One case in this process: ``{"peak_extra_bytes", "seconds", "grad_bytes"}``."""
    from miles_core.log_prob_head import dense_log_probs, fused_log_probs

    torch.manual_seed(0)
    dt = DTYPES[dtype]
    h = (torch.randn(tokens, hidden, device=device) * 0.5).to(dt).requires_grad_(True)
    w = (torch.randn(VOCAB, hidden, device=device) * 0.02).to(dt).requires_grad_(True)
    targets = torch.randint(0, VOCAB, (tokens,), device=device)
    a = torch.randn(tokens, device=device)
    b = torch.randn(tokens, device=device) * 0.01
    cuda = device.startswith("cuda")

    def step():
        if path == "fused":
            lp, ent = fused_log_probs(h, w, targets, 1.0)
        else:
            lp, ent = dense_log_probs(h @ w.t(), targets, 1.0, entropy_grad=True)
        ((lp * a).sum() + (ent * b).sum()).backward()

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_peak_bytes()
    seconds = []
    for _ in range(repeats):
        h.grad = w.grad = None
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if cuda else _rss_peak_bytes()
    grad_bytes = h.grad.numel() * h.grad.element_size() + w.grad.numel() * w.grad.element_size()
    return {"peak_extra_bytes": peak - base, "seconds": min(seconds), "grad_bytes": grad_bytes}


def spawn_case(args, path: str, tokens: int, hidden: int) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        path,
        "--tokens",
        str(tokens),
        "--hidden",
        str(hidden),
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--repeats",
        str(args.repeats),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["killed"])[-1]
        oom = "out of memory" in proc.stderr.lower() or proc.returncode in (-9, 137)
        return {"error": "OOM" if oom else tail[:200]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--hidden", type=int, nargs="+", default=[1024])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", choices=("dense", "fused"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        res = run_case(
            args.child, args.tokens[0], args.hidden[0], args.dtype, args.device, args.repeats
        )
        print(json.dumps(res))
        return

    rows = []
    for hidden in args.hidden:
        for tokens in args.tokens:
            row = {"tokens": tokens, "hidden": hidden, "vocab": VOCAB}
            for path in ("dense", "fused"):
                row[path] = spawn_case(args, path, tokens, hidden)
            d, f = row["dense"], row["fused"]
            if "error" not in d and "error" not in f:
                row["memory_ratio"] = f["peak_extra_bytes"] / d["peak_extra_bytes"]
                row["time_ratio"] = f["seconds"] / d["seconds"]
            rows.append(row)
            print(_format(row), flush=True)
    result = {
        "device": args.device,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)


def _cell(case: dict) -> str:
    if "error" in case:
        return f"{case['error']:>22}"
    return f"{case['peak_extra_bytes'] / 2**30:8.2f} GiB {case['seconds']:8.2f} s"


def _format(row: dict) -> str:
    ratio = ""
    if "memory_ratio" in row:
        ratio = f"  mem {row['memory_ratio']:.3f}x  time {row['time_ratio']:.2f}x"
    grads = row["fused"].get("grad_bytes", 0) / 2**30
    return (
        f"T={row['tokens']:6d} H={row['hidden']:5d}  dense {_cell(row['dense'])}  "
        f"fused {_cell(row['fused'])}  (grads {grads:.2f} GiB){ratio}"
    )


if __name__ == "__main__":
    main()
