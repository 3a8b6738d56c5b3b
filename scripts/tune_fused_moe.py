"""Tune the fused MoE kernels' block sizes on this GPU and write the config table.

Writes (merging) ``native/src/miles_native/kernels/configs/<device>.json``, the table that
``miles_native.kernels.get_config`` reads, or ``--table PATH``. GPU only; a few minutes per
token count. Defaults: the Qwen3-30B-A3B expert layer (128 experts, top-8, hidden 2048,
intermediate 768), bf16, at 4k/16k/64k tokens.

Usage::

    python scripts/tune_fused_moe.py
    python scripts/tune_fused_moe.py --tokens 16384 --experts 64 --hidden 4096 --intermediate 1408
"""

import argparse
from pathlib import Path

import torch


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--table", type=Path, help="table file (default: the package's)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")

    from miles_native.kernels import fused_moe_configs
    from miles_native.kernels.fused_moe_tuning import tune

    dtype = getattr(torch, args.dtype)
    device_name = torch.cuda.get_device_name()
    path = args.table or fused_moe_configs.device_table_path(device_name)
    key = fused_moe_configs.shape_key(
        args.experts, args.hidden, args.intermediate, args.top_k, dtype
    )
    for num_tokens in args.tokens:
        print(f"== {key} tokens={num_tokens}", flush=True)
        cfg = tune(num_tokens, args.experts, args.hidden, args.intermediate, args.top_k, dtype)
        fused_moe_configs.save_table(path, device_name, {key: {num_tokens: cfg}})
        print(f"wrote {path}: {cfg}", flush=True)


if __name__ == "__main__":
    main()
