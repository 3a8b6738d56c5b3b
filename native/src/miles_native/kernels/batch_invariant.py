"""Batch-invariant ops of ``--true-on-policy`` on a GPU, as differentiable functions.

The forward values come from the Triton kernels of
:mod:`miles_native.kernels.batch_invariant_kernels`: a row's result is the same bits whatever
the batch, padding or pack it is computed in (the module doc there says why). The backward is
plain torch (only the forward values must agree between the engine and the trainer).

* :func:`linear`: ``F.linear`` (``x @ W.T + b``), output in the input dtype.
* :func:`attention`: transformers' attention contract over a boolean mask whose allowed keys
  are one contiguous range per query (left-padded prefill, decode against a KV cache, a packed
  row's block-diagonal causal mask); another mask is refused with one line. Its backward
  recomputes torch's SDPA under the mask (a packed training row has a faster one,
  ``miles_core.batch_invariant.packed_attention``: the same forward, torch's varlen flash
  backward).
* :func:`row_mean`: ``x.mean(-1)`` (RMSNorm's variance).
* :func:`log_softmax`: ``log_softmax(x.float() / T, -1)`` with a temperature per row or one
  for all, in fp32.

fp32 matmuls use IEEE products (no TF32); bf16/fp16 use the tensor cores, fp32 accumulation.
"""

from __future__ import annotations

import torch
import triton

from miles_native.kernels.batch_invariant_kernels import (
    attention_kernel,
    log_softmax_kernel,
    matmul_kernel,
    row_mean_kernel,
)

INTERPRETED = bool(triton.knobs.runtime.interpret)
#: The one tiling of every matmul of a dtype, ``(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)``
#: (never autotuned, never chosen by shape: a row's arithmetic must not change). 16-bit inputs
#: run Hopper's warp-group MMA on 128-row tiles; fp32 (IEEE products, FMA) on smaller ones.
MATMUL_CONFIGS = {
    torch.bfloat16: (128, 128, 64, 8, 3),
    torch.float16: (128, 128, 64, 8, 3),
    torch.float32: (64, 128, 64, 4, 3),
}
#: The attention kernel's one tiling ``(BLOCK_M queries, BLOCK_N keys, warps, stages)``, every
#: dtype and shape (a query's arithmetic follows its key blocks, never the launch).
ATTN_CONFIG = (64, 64, 4, 2)
ATTN_BLOCK_N = ATTN_CONFIG[1]
#: Lanes of the row reductions.
ROW_BLOCK = 1024
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _interpreter_fixes(dtype: torch.dtype) -> bool:
    return INTERPRETED and dtype != torch.float32


def _check_dtype(what: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise TypeError(f"batch-invariant {what}: dtype {t.dtype} (float32/bfloat16/float16)")


# ---------------------------------------------------------------------------------- linear
def linear_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` by :func:`matmul_kernel` (no autograd)."""
    _check_dtype("linear", x, weight)
    if x.dtype != weight.dtype:
        raise TypeError(f"batch-invariant linear: input {x.dtype}, weight {weight.dtype}")
    n, k = weight.shape
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    m = rows.shape[0]
    if m:
        block_m, block_n, block_k, warps, stages = MATMUL_CONFIGS[x.dtype]
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        matmul_kernel[grid](
            rows, w, bias if bias is not None else w, out, m, n, k, rows.stride(0), w.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            DOT_PRECISION="ieee", INTERPRETER=_interpreter_fixes(x.dtype),
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return linear_forward(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gx = grad @ weight if ctx.needs_input_grad[0] else None
        g2 = grad.reshape(-1, grad.shape[-1])
        gw = g2.T @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear`` with batch-invariant forward values."""
    return _Linear.apply(x, weight, bias)


# ------------------------------------------------------------------------------- attention
def key_spans(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(start, end)`` int32 ``[Bm, Tq]`` of a boolean ``(Bm, 1, Tq, Tk)`` mask whose allowed
    keys are one contiguous range per query (a query with none gets ``start == end == 0``)."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
        raise ValueError(f"batch-invariant attention needs a boolean (B, 1, Tq, Tk) mask, got "
                         f"{mask.dtype} {tuple(mask.shape)}")  # fmt: skip
    m = mask[:, 0]
    tk = m.shape[-1]
    allowed = m.any(-1)
    start = m.to(torch.int32).argmax(-1)
    end = tk - m.flip(-1).to(torch.int32).argmax(-1)
    count = m.sum(-1)
    if not bool(((count == end - start) | ~allowed).all()):
        raise ValueError(
            "batch-invariant attention: a query's allowed keys are not one contiguous range "
            "(the mode computes left-padded prefill, decode against the cache and packed rows)"
        )
    zero = torch.zeros_like(start)
    start = torch.where(allowed, start, zero).to(torch.int32).contiguous()
    end = torch.where(allowed, end, zero).to(torch.int32).contiguous()
    return start, end


def attention_forward(q, k, v, start, end, scale: float) -> torch.Tensor:
    """``q (B, H, Tq, D)``, ``k``/``v`` ``(B, Hkv, Tk, D)`` (unit stride on D), spans from
    :func:`key_spans`; returns ``(B, Tq, H, D)`` contiguous in ``q``'s dtype."""
    _check_dtype("attention", q, k, v)
    batch, heads, tq, dim = q.shape
    group = heads // k.shape[1]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty(batch, tq, heads, dim, dtype=q.dtype, device=q.device)
    if out.numel():
        block_m, block_n, warps, stages = ATTN_CONFIG
        attention_kernel[(batch * triton.cdiv(tq, block_m), heads)](
            q, k, v, out, start, end, tq, heads, group, float(scale),
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            0 if start.shape[0] == 1 else start.stride(0),
            D=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_M=block_m,
            BLOCK_N=block_n, DOT_PRECISION="ieee", INTERPRETER=_interpreter_fixes(q.dtype),
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return out


#: ``(mask, its version, its spans)`` of the last call: transformers passes one mask object to
#: every layer of a forward, so its spans (and their one host sync) are computed once.
_last_spans: tuple[torch.Tensor, int, tuple[torch.Tensor, torch.Tensor]] | None = None


def _spans_of(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    global _last_spans
    last = _last_spans
    if last is not None and last[0] is mask and last[1] == mask._version:
        return last[2]
    spans = key_spans(mask)
    _last_spans = (mask, mask._version, spans)
    return spans


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        start, end = _spans_of(mask)
        ctx.save_for_backward(q, k, v, mask)
        ctx.scale = scale
        return attention_forward(q, k, v, start, end, scale)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, mask = ctx.saved_tensors
        group = q.shape[1] // k.shape[1]
        # recompute with torch's SDPA; a query with no key (output zeros, no gradient) attends
        # to all keys with a zero incoming gradient so that SDPA's softmax stays finite
        empty = ~mask.any(-1, keepdim=True)
        with torch.enable_grad():
            q_, k_, v_ = (t.detach().requires_grad_(True) for t in (q, k, v))
            y = torch.nn.functional.scaled_dot_product_attention(
                q_, k_.repeat_interleave(group, 1), v_.repeat_interleave(group, 1),
                attn_mask=mask | empty, scale=ctx.scale,
            )  # fmt: skip
            g = grad.transpose(1, 2).masked_fill(empty, 0)
            gq, gk, gv = torch.autograd.grad(y, (q_, k_, v_), g)
        return gq, gk, gv, None, None


def attention(q, k, v, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Batch-invariant attention (see the module doc); ``(B, Tq, H, D)``."""
    return _Attention.apply(q, k, v, mask, scale)


# ------------------------------------------------------------------------ row reductions
def row_mean_forward(x: torch.Tensor) -> torch.Tensor:
    """``x.mean(-1)`` by :func:`row_mean_kernel` (no autograd); shape ``x.shape[:-1]``."""
    _check_dtype("mean", x)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], dtype=x.dtype, device=x.device)
    if rows.shape[0] and rows.shape[1]:
        row_mean_kernel[(rows.shape[0],)](
            rows, out, rows.shape[1], rows.stride(0),
            BLOCK=ROW_BLOCK, INTERPRETER=_interpreter_fixes(x.dtype),
        )  # fmt: skip
    return out.reshape(x.shape[:-1])


class _RowMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.n = x.shape[-1]
        return row_mean_forward(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad / ctx.n).unsqueeze(-1).expand(*grad.shape, ctx.n)


def row_mean(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """``x.mean(-1, keepdim=keepdim)`` with batch-invariant forward values."""
    y = _RowMean.apply(x)
    return y.unsqueeze(-1) if keepdim else y


def log_softmax_forward(x: torch.Tensor, temperature: torch.Tensor | float) -> torch.Tensor:
    """fp32 ``log_softmax(x.float() / temperature, -1)`` by :func:`log_softmax_kernel`;
    ``temperature`` a float or a tensor of one value per row (any shape that holds them)."""
    _check_dtype("log_softmax", x)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if isinstance(temperature, torch.Tensor):
        temps = temperature.to(device=x.device, dtype=torch.float32).reshape(-1)
    else:  # a fill on the device: a Python number through torch.tensor is a blocking copy
        temps = torch.full((1,), float(temperature), dtype=torch.float32, device=x.device)
    if temps.numel() not in (1, rows.shape[0]):
        raise ValueError(f"log_softmax: {temps.numel()} temperatures for {rows.shape[0]} rows")
    out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    if rows.shape[0] and rows.shape[1]:
        log_softmax_kernel[(rows.shape[0],)](
            rows, temps.contiguous(), out, rows.shape[1], rows.stride(0),
            0 if temps.numel() == 1 else 1, BLOCK=ROW_BLOCK,
        )  # fmt: skip
    return out.reshape(x.shape)


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, temperature):
        out = log_softmax_forward(x, temperature)
        ctx.save_for_backward(out)
        ctx.temperature = temperature
        ctx.dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        # grad - softmax * sum(grad), divided by T: one [rows, V] fp32 temporary, in place
        gz = out.exp().mul_(grad.sum(-1, keepdim=True)).neg_().add_(grad)
        temps = ctx.temperature
        if isinstance(temps, torch.Tensor):
            temps = temps.reshape(*out.shape[:-1], 1) if temps.numel() > 1 else temps.reshape(())
        return gz.div_(temps).to(ctx.dtype), None


def log_softmax(x: torch.Tensor, temperature: torch.Tensor | float = 1.0) -> torch.Tensor:
    """fp32 ``log_softmax(x.float() / temperature, -1)`` with batch-invariant forward values."""
    return _LogSoftmax.apply(x, temperature)
