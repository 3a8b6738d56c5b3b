"""The per-GPU trainer memory table of docs/scale.md, from the memory plan's own arithmetic
(``miles_launch.memory_estimate``, what ``miles train`` prints): 8B to 1T-parameter models on 8 to
1024 GPUs, in the layouts a user would pick.

    python scripts/scale_table.py [--tokens 16384] [--gpu-memory-gib 80] > table.md

The shapes are the published configs' sizes (Qwen3-8B, Qwen3-32B, Llama-3-70B, Qwen3-235B-A22B,
Kimi-K2 for 1T: DeepSeek-V3's latent attention, 384 experts); bf16 compute, fp32 masters and
AdamW state on the GPU, the fused log-prob head, one micro-batch of ``--tokens`` tokens per GPU
(each CP rank holding that many), gradients counted whole (a step of several micro-batches).
Prints a Markdown table; no GPU, no model, nothing downloaded.
"""

from __future__ import annotations

import argparse

from miles_launch.memory_estimate import GiB, TrainerLayout, trainer_estimate
from miles_launch.model_shape import ModelShape

QWEN = dict(model_type="qwen3", vocab=151936, head_dim=128, tied=False, qk_norm=True)
SHAPES = {
    "8B": ModelShape(**QWEN, layers=36, hidden=4096, intermediate=12288, heads=32, kv_heads=8),
    "32B": ModelShape(**QWEN, layers=64, hidden=5120, intermediate=25600, heads=64, kv_heads=8),
    "70B": ModelShape(
        model_type="llama", layers=80, hidden=8192, intermediate=28672, vocab=128256, heads=64,
        kv_heads=8, head_dim=128, tied=False,
    ),
    "235B-A22B": ModelShape(
        **{**QWEN, "model_type": "qwen3_moe"}, layers=94, hidden=4096, intermediate=12288,
        heads=64, kv_heads=4, experts=128, experts_per_token=8, moe_intermediate=1536,
        sparse_layers=94,
    ),
    "1T-A32B": ModelShape(
        model_type="deepseek_v3", layers=61, hidden=7168, intermediate=18432, vocab=163840,
        heads=64, kv_heads=64, head_dim=192, tied=False, experts=384, experts_per_token=8,
        moe_intermediate=2048, shared_intermediate=2048, sparse_layers=60, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    ),
}  # fmt: skip

#: (shape, GPUs, layout fields): the layouts a user would pick, recompute on everywhere.
ROWS = [
    ("8B", 8, dict(backend="fsdp")),
    ("8B", 8, dict(backend="megatron", tp=2, sequence_parallel=True)),
    ("8B", 64, dict(backend="fsdp")),
    ("32B", 8, dict(backend="fsdp")),
    ("32B", 32, dict(backend="fsdp")),
    ("32B", 32, dict(backend="megatron", tp=4, sequence_parallel=True)),
    ("32B", 256, dict(backend="megatron", tp=8, sequence_parallel=True)),
    ("70B", 16, dict(backend="fsdp")),
    ("70B", 64, dict(backend="fsdp")),
    ("70B", 64, dict(backend="megatron", tp=8, pp=2, sequence_parallel=True)),
    ("70B", 256, dict(backend="megatron", tp=8, pp=2, sequence_parallel=True)),
    ("235B-A22B", 64, dict(backend="fsdp")),
    ("235B-A22B", 128, dict(backend="megatron", tp=4, pp=4, ep=8, sequence_parallel=True)),
    ("235B-A22B", 256, dict(backend="megatron", tp=4, pp=4, ep=16, sequence_parallel=True)),
    ("1T-A32B", 256, dict(backend="megatron", tp=8, pp=8, ep=32, sequence_parallel=True)),
    ("1T-A32B", 512, dict(backend="megatron", tp=8, pp=8, ep=64, sequence_parallel=True)),
    ("1T-A32B", 1024, dict(backend="megatron", tp=8, pp=16, ep=64, sequence_parallel=True)),
    ("1T-A32B", 1024, dict(backend="fsdp")),
]


def layout_name(fields: dict) -> str:
    if fields["backend"] == "fsdp":
        return "FSDP"
    parts = [f"{k.upper()} {fields[k]}" for k in ("tp", "pp", "ep") if fields.get(k, 1) > 1]
    return "Megatron " + " x ".join(parts) + (" SP" if fields.get("sequence_parallel") else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="--max-tokens-per-gpu")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0)
    args = parser.parse_args()
    print(
        "| model | params | GPUs | layout | parameters | gradients | optimizer | activations "
        "| head | gathered | peak GiB | fits "
        f"{args.gpu_memory_gib:g} GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, gpus, fields in ROWS:
        shape = SHAPES[name]
        layout = TrainerLayout(ranks=gpus, tokens=args.tokens, recompute="full", etp=1, **fields)
        gpu, _ = trainer_estimate(shape, layout)
        t = {k: v / GiB for k, v in gpu.terms.items()}
        peak = max(v for k, v in gpu.phases.items() if k != "publishing") / GiB
        print(
            f"| {name} | {shape.total_params() / 1e9:.0f}B | {gpus} | {layout_name(fields)} "
            f"| {t['parameters']:.1f} | {t['gradients']:.1f} | {t['optimizer']:.1f} "
            f"| {t['activations']:.1f} | {t['log-prob head']:.1f} | {t.get('gathered', 0.0):.1f} "
            f"| **{peak:.1f}** | {'yes' if peak <= args.gpu_memory_gib else 'no'} |"
        )


if __name__ == "__main__":
    main()
