"""Fused MoE expert layer: forward and hand-written backward in one autograd Function.

For token ``t`` with routed experts ``e_j = topk_ids[t, j]`` and weights ``p_j``::

    out[t] = sum_j p_j * w_down[e_j] @ (silu(g) * u),   [g; u] = w_gate_up[e_j] @ x[t]

Weight layout is that of transformers' batched experts (``Qwen3MoeExperts`` and friends,
``nn.functional.linear`` convention): ``w_gate_up [E, 2I, H]`` with the gate in rows ``[0, I)``
and the up projection in rows ``[I, 2I)``; ``w_down [E, H, I]``.

Forward: align (sort assignments by expert, pad groups to ``block_m``) -> grouped GEMM for
gate+up with the SiLU-and-mul epilogue, which also applies the routing weight ``p`` -> grouped
GEMM for down, scattered to assignment rows -> top-k sum. Backward: ``dy @ w_down`` with the
SiLU-and-mul backward and routing-weight-gradient epilogue -> ``dh @ w_gate_up`` -> top-k sum
(``dx``), and per-expert reductions ``d w_gate_up = dh^T x`` and ``d w_down = dy^T (p act)``.
All results are deterministic (no atomics). Saved for backward: ``h [P, 2I]`` and the weighted
activation ``[P, I]`` (``P ~ T k``), besides the inputs.

fp32 inputs use IEEE fp32 products unless ``torch.backends.cuda.matmul.allow_tf32`` is set;
bf16/fp16 use the tensor cores with fp32 accumulation.
"""

import torch
import triton

from miles_native.kernels.fused_moe_configs import (
    FusedMoEConfig,
    GemmConfig,
    WeightGradConfig,
    get_config,
)
from miles_native.kernels.fused_moe_kernels import (
    down_bwd_kernel,
    expert_weight_grad_kernel,
    gate_up_fwd_kernel,
    grouped_gemm_scatter_kernel,
    topk_sum_kernel,
)
from miles_native.kernels.moe_align import MoEAlignment, align_by_expert

INTERPRETED = bool(triton.knobs.runtime.interpret)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _dot_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _interpreter_fixes(dtype: torch.dtype) -> bool:
    return INTERPRETED and dtype != torch.float32


def _topk_sum(y: torch.Tensor, num_tokens: int, top_k: int, out_dtype: torch.dtype):
    hidden = y.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=out_dtype, device=y.device)
    if num_tokens == 0:
        return out
    block_h = min(1024, triton.next_power_of_2(hidden))
    grid = (num_tokens, triton.cdiv(hidden, block_h))
    topk_sum_kernel[grid](
        y,
        out,
        hidden,
        y.stride(0),
        out.stride(0),
        TOP_K=top_k,
        BLOCK_H=block_h,
        INTERPRETER=_interpreter_fixes(out_dtype),
    )
    return out


def launch_gate_up(x, w1, weights, align: MoEAlignment, top_k: int, cfg: GemmConfig):
    """``h [P, 2I]`` pre-activations and ``act [P, I] = p * silu(g) * u`` in aligned order."""
    inter, hidden = w1.shape[1] // 2, w1.shape[2]
    h = torch.empty(align.max_rows, 2 * inter, dtype=x.dtype, device=x.device)
    act = torch.empty(align.max_rows, inter, dtype=x.dtype, device=x.device)
    grid = (align.max_blocks * triton.cdiv(inter, cfg.block_n),)
    gate_up_fwd_kernel[grid](
        x, w1, h, act, weights, align.sorted_ids, align.block_expert, align.num_assignments,
        hidden, inter,
        x.stride(0), x.stride(1), w1.stride(0), w1.stride(1), w1.stride(2),
        h.stride(0), act.stride(0),
        TOP_K=top_k, BLOCK_M=align.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_PRECISION=_dot_precision(x.dtype), INTERPRETER=_interpreter_fixes(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return h, act


def launch_scatter_gemm(a, b, b_strides, n_dim, align, cfg: GemmConfig):
    """``c [S, N]``: ``c[a(r)] = a[r] @ b[e]^T`` for valid rows; ``b_strides = (e, n, k)``."""
    k_dim = a.shape[1]
    c = torch.empty(align.num_assignments, n_dim, dtype=a.dtype, device=a.device)
    grid = (align.max_blocks * triton.cdiv(n_dim, cfg.block_n),)
    grouped_gemm_scatter_kernel[grid](
        a, b, c, align.sorted_ids, align.block_expert, align.num_assignments, n_dim, k_dim,
        a.stride(0), a.stride(1), *b_strides, c.stride(0), c.stride(1),
        BLOCK_M=align.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_PRECISION=_dot_precision(a.dtype), INTERPRETER=_interpreter_fixes(a.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return c


def launch_down_bwd(dy, w2, h, weights, align: MoEAlignment, top_k: int, cfg: GemmConfig):
    """``dh [P, 2I]`` and the routing-weight gradient ``d_p [S]`` (fp32)."""
    hidden, inter = w2.shape[1], w2.shape[2]
    num_n = triton.cdiv(inter, cfg.block_n)
    dh = torch.empty_like(h)
    partial = torch.empty(align.num_assignments, num_n, dtype=torch.float32, device=dy.device)
    grid = (align.max_blocks * num_n,)
    down_bwd_kernel[grid](
        dy, w2, h, weights, dh, partial, align.sorted_ids, align.block_expert,
        align.num_assignments, hidden, inter,
        dy.stride(0), dy.stride(1), w2.stride(0), w2.stride(1), w2.stride(2),
        h.stride(0), dh.stride(0), partial.stride(0),
        TOP_K=top_k, BLOCK_M=align.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_PRECISION=_dot_precision(dy.dtype), INTERPRETER=_interpreter_fixes(dy.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return dh, partial.sum(dim=1)


def launch_weight_grad(
    left, right, out, out_strides, m_dim, n_dim, align, top_k, cfg: WeightGradConfig
):
    """``out[e]`` (``M x N`` through ``out_strides = (e, m, n)``) ``= sum_r left[tok]^T right[r]``."""
    num_experts = align.expert_pstarts.numel() - 1
    grid = (triton.cdiv(m_dim, cfg.block_m) * triton.cdiv(n_dim, cfg.block_n), num_experts)
    expert_weight_grad_kernel[grid](
        left, right, out, align.sorted_ids, align.expert_pstarts, align.num_assignments,
        m_dim, n_dim, left.stride(0), left.stride(1), right.stride(0), right.stride(1),
        *out_strides,
        TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_PRECISION=_dot_precision(left.dtype), INTERPRETER=_interpreter_fixes(left.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def moe_forward(x, w1, w2, topk_ids, weights, cfg: FusedMoEConfig):
    """Forward; returns ``(out, h, act, align)`` (the last three are what the backward needs)."""
    num_tokens, top_k = topk_ids.shape
    align = align_by_expert(topk_ids, w1.shape[0], cfg.block_m)
    h, act = launch_gate_up(x, w1, weights, align, top_k, cfg.gate_up)
    w2_strides = (w2.stride(0), w2.stride(1), w2.stride(2))  # n = H, k = I
    y = launch_scatter_gemm(act, w2, w2_strides, w2.shape[1], align, cfg.down)
    return _topk_sum(y, num_tokens, top_k, x.dtype), h, act, align


def moe_backward(dy, x, w1, w2, weights, h, act, align: MoEAlignment, top_k, cfg, needs):
    """Gradients ``(dx, dw1, dw2, d_weights)``; entries whose ``needs`` flag is False are None.

    ``dw2[e] = sum_r dy[tok(r)]^T act[r]`` (``act`` already carries the routing weight),
    ``dw1[e] = sum_r dh[r]^T x[tok(r)]``, ``dx[t] = sum_j dh[r(t, j)] @ w1[e_j]``.
    """
    need_x, need_w1, need_w2, need_p = needs
    num_tokens, hidden = x.shape
    inter = w2.shape[2]
    dx = dw1 = dw2 = dp = None
    if need_x or need_w1 or need_p:
        dh, dp_flat = launch_down_bwd(dy, w2, h, weights, align, top_k, cfg.down_bwd)
        if need_p:
            dp = dp_flat.view(num_tokens, top_k).to(weights.dtype)
        if need_x:
            w1_strides = (w1.stride(0), w1.stride(2), w1.stride(1))  # n = H, k = 2I
            dx_k = launch_scatter_gemm(dh, w1, w1_strides, hidden, align, cfg.dx)
            dx = _topk_sum(dx_k, num_tokens, top_k, x.dtype)
        if need_w1:
            dw1 = torch.empty_like(w1)
            strides = (dw1.stride(0), dw1.stride(2), dw1.stride(1))  # m = H, n = 2I
            launch_weight_grad(x, dh, dw1, strides, hidden, 2 * inter, align, top_k, cfg.dw_gate_up)
    if need_w2:
        dw2 = torch.empty_like(w2)
        strides = (dw2.stride(0), dw2.stride(1), dw2.stride(2))  # m = H, n = I
        launch_weight_grad(dy, act, dw2, strides, hidden, inter, align, top_k, cfg.dw_down)
    return dx, dw1, dw2, dp


class FusedExpertsFunction(torch.autograd.Function):
    """Autograd Function over :func:`moe_forward` / :func:`moe_backward` (no grad for ids)."""

    @staticmethod
    def forward(ctx, x, w1, w2, topk_ids, weights, cfg):
        out, h, act, align = moe_forward(x, w1, w2, topk_ids, weights, cfg)
        ctx.save_for_backward(x, w1, w2, weights, h, act)
        ctx.align, ctx.cfg, ctx.top_k = align, cfg, topk_ids.shape[1]
        return out

    @staticmethod
    def backward(ctx, dy):
        x, w1, w2, weights, h, act = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2])
        needs = (*needs, ctx.needs_input_grad[4])
        dx, dw1, dw2, dp = moe_backward(
            dy.contiguous(), x, w1, w2, weights, h, act, ctx.align, ctx.top_k, ctx.cfg, needs
        )
        return dx, dw1, dw2, None, dp, None


def _check_inputs(x, w_gate_up, w_down, topk_ids, topk_weights):
    if x.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(
            "fused_experts: expected hidden [T, H], w_gate_up [E, 2I, H], w_down [E, H, I]; got "
            f"{tuple(x.shape)}, {tuple(w_gate_up.shape)}, {tuple(w_down.shape)}"
        )
    num_tokens, hidden = x.shape
    num_experts, two_inter, w1_hidden = w_gate_up.shape
    if (
        w1_hidden != hidden
        or two_inter % 2
        or w_down.shape != (num_experts, hidden, two_inter // 2)
    ):
        raise ValueError(
            f"fused_experts: w_gate_up {tuple(w_gate_up.shape)} / w_down {tuple(w_down.shape)} do "
            f"not match hidden size {hidden} as [E, 2I, H] / [E, H, I]"
        )
    if (
        topk_ids.dim() != 2
        or topk_ids.shape[0] != num_tokens
        or topk_weights.shape != topk_ids.shape
    ):
        raise ValueError(
            f"fused_experts: topk_ids {tuple(topk_ids.shape)} and topk_weights "
            f"{tuple(topk_weights.shape)} must both be [T={num_tokens}, k]"
        )
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_experts: topk_ids must be int32/int64, got {topk_ids.dtype}")
    if x.dtype not in _DTYPES or w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise ValueError(
            "fused_experts: hidden and both weights must share one dtype of "
            f"bf16/fp16/fp32; got {x.dtype}, {w_gate_up.dtype}, {w_down.dtype}"
        )
    devices = {t.device for t in (x, w_gate_up, w_down, topk_ids, topk_weights)}
    if len(devices) != 1:
        raise ValueError(f"fused_experts: all inputs must be on one device, got {devices}")
    if x.device.type == "cuda" and INTERPRETED:
        raise RuntimeError("fused_experts: CUDA inputs, but TRITON_INTERPRET=1 was set at import")
    if x.device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            f"fused_experts: inputs on {x.device.type}; the Triton kernels run on CUDA, or on the "
            "CPU under the interpreter (TRITON_INTERPRET=1 before importing miles_native.kernels)"
        )


def fused_experts(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    config: FusedMoEConfig | None = None,
) -> torch.Tensor:
    """MoE expert layer ``[T, H] -> [T, H]`` (see the module docstring for the formula/layout).

    Differentiable in ``hidden``, ``w_gate_up``, ``w_down`` and ``topk_weights``. ``topk_ids``
    values must lie in ``[0, E)``. ``config`` defaults to the tuned table entry for this shape
    on this device (:func:`~miles_native.kernels.fused_moe_configs.get_config`).
    """
    _check_inputs(hidden, w_gate_up, w_down, topk_ids, topk_weights)
    if config is None:
        num_experts, two_inter, h = w_gate_up.shape
        config = get_config(
            hidden.shape[0], num_experts, h, two_inter // 2, topk_ids.shape[1], hidden.dtype,
            hidden.device,
        )  # fmt: skip
    return FusedExpertsFunction.apply(
        hidden.contiguous(),
        w_gate_up,
        w_down,
        topk_ids.contiguous(),
        topk_weights.contiguous(),
        config,
    )
