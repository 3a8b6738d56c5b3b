"""Autotuning of the fused MoE block sizes on a GPU (writes the table that get_config reads).

Each kernel is timed on its own with ``triton.testing.do_bench`` over a small candidate grid,
on random inputs of the layer's shape with a uniform random routing. ``block_m`` is shared by
the four row-blocked kernels, so those are tuned for each ``block_m`` candidate and the
``block_m`` with the smallest summed time wins; the two weight-gradient kernels are tuned
independently. Candidates that fail to compile (shared memory) are skipped.
"""

import itertools
from collections.abc import Callable

import torch
import triton

from miles_native.kernels.fused_moe import (
    launch_down_bwd,
    launch_gate_up,
    launch_scatter_gemm,
    launch_weight_grad,
)
from miles_native.kernels.fused_moe_configs import FusedMoEConfig, GemmConfig, WeightGradConfig
from miles_native.kernels.moe_align import align_by_expert

BLOCK_M = (64, 128)
_STAGES = ((4, 3), (4, 4), (8, 3), (8, 4))  # (num_warps, num_stages)
GEMM_SPACE = [
    GemmConfig(n, k, w, s)
    for (n, k), (w, s) in itertools.product(((64, 64), (128, 64), (256, 64)), _STAGES)
]
GATE_UP_SPACE = [
    GemmConfig(n, k, w, s) for (n, k), (w, s) in itertools.product(((64, 64), (128, 64)), _STAGES)
]
WGRAD_SPACE = [
    WeightGradConfig(m, n, k, w, s)
    for (m, n, k), (w, s) in itertools.product(
        ((128, 128, 64), (128, 128, 32), (128, 64, 64), (64, 128, 64), (64, 64, 64)), _STAGES
    )
]


def _best(run: Callable, space: list, log: Callable[[str], None], label: str):
    best_cfg, best_ms = None, float("inf")
    for cfg in space:
        try:
            ms = triton.testing.do_bench(lambda c=cfg: run(c), warmup=5, rep=20)
        except Exception as err:  # noqa: BLE001 - out-of-resources configs are expected
            log(f"  {label} {cfg}: skipped ({type(err).__name__})")
            continue
        if ms < best_ms:
            best_cfg, best_ms = cfg, ms
    if best_cfg is None:
        raise RuntimeError(f"no {label} candidate ran")
    log(f"  {label}: {best_cfg} {best_ms:.3f} ms")
    return best_cfg, best_ms


def _tune_row_kernels(block_m, x, dy, w1, w2, ids, weights, log):
    """Best tiles of the four row-blocked kernels for one ``block_m``; summed time first."""
    num_experts, hidden, inter = w2.shape
    top_k = ids.shape[1]
    align = align_by_expert(ids, num_experts, block_m)
    h, act = launch_gate_up(x, w1, weights, align, top_k, GATE_UP_SPACE[0])
    dh, _ = launch_down_bwd(dy, w2, h, weights, align, top_k, GEMM_SPACE[0])
    w2_strides = (w2.stride(0), w2.stride(1), w2.stride(2))
    w1_strides = (w1.stride(0), w1.stride(2), w1.stride(1))
    log(f"block_m={block_m}")
    gate_up, t1 = _best(
        lambda c: launch_gate_up(x, w1, weights, align, top_k, c), GATE_UP_SPACE, log, "gate_up"
    )
    down, t2 = _best(
        lambda c: launch_scatter_gemm(act, w2, w2_strides, hidden, align, c),
        GEMM_SPACE,
        log,
        "down",
    )
    down_bwd, t3 = _best(
        lambda c: launch_down_bwd(dy, w2, h, weights, align, top_k, c), GEMM_SPACE, log, "down_bwd"
    )
    dx, t4 = _best(
        lambda c: launch_scatter_gemm(dh, w1, w1_strides, hidden, align, c),
        GEMM_SPACE,
        log,
        "dx",
    )
    log(f"block_m={block_m}: row kernels {t1 + t2 + t3 + t4:.3f} ms")
    return t1 + t2 + t3 + t4, block_m, (gate_up, down, down_bwd, dx), (align, act, dh)


def tune(
    num_tokens: int,
    num_experts: int,
    hidden: int,
    inter: int,
    top_k: int,
    dtype: torch.dtype = torch.bfloat16,
    log: Callable[[str], None] = print,
) -> FusedMoEConfig:
    """Best config for this layer shape at ``num_tokens`` tokens on the current CUDA device."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(num_tokens, hidden, device=dev, dtype=dtype, generator=gen)
    dy = torch.randn_like(x)
    w1 = torch.randn(num_experts, 2 * inter, hidden, device=dev, dtype=dtype, generator=gen) * 0.02
    w2 = torch.randn(num_experts, hidden, inter, device=dev, dtype=dtype, generator=gen) * 0.02
    logits = torch.randn(num_tokens, num_experts, device=dev, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    weights = weights.to(dtype)

    runs = [_tune_row_kernels(bm, x, dy, w1, w2, ids, weights, log) for bm in BLOCK_M]
    total, block_m, (gate_up, down, down_bwd, dx), (align, act, dh) = min(runs, key=lambda r: r[0])
    dw1 = torch.empty_like(w1)
    dw1_strides = (dw1.stride(0), dw1.stride(2), dw1.stride(1))
    dw2 = torch.empty_like(w2)
    dw2_strides = (dw2.stride(0), dw2.stride(1), dw2.stride(2))
    dw_gate_up, _ = _best(
        lambda c: launch_weight_grad(x, dh, dw1, dw1_strides, hidden, 2 * inter, align, top_k, c),
        WGRAD_SPACE,
        log,
        "dw_gate_up",
    )
    dw_down, _ = _best(
        lambda c: launch_weight_grad(dy, act, dw2, dw2_strides, hidden, inter, align, top_k, c),
        WGRAD_SPACE,
        log,
        "dw_down",
    )
    return FusedMoEConfig(block_m, gate_up, down, down_bwd, dx, dw_gate_up, dw_down)
