"""Triton kernels of ``--true-on-policy`` on a GPU (:mod:`miles_native.kernels.batch_invariant`).

Each output row is computed by one fixed sequence of operations that depends only on the row's
own data and on compile-time constants (block sizes, the reduced length), never on how many
rows the launch carries, where the row sits among them, or padding:

* :func:`matmul_kernel`: ``x @ W.T (+ b)`` with fixed ``BLOCK_M/N/K``, no split-K, the K loop in
  one order, fp32 accumulation, one rounding on store. A tile's dot computes each output element
  from its own row of ``x`` and column of ``W.T`` only (the other rows of the tile do not enter
  it), so a row's bits are those of any tile it lands in. ``M`` is not specialized on (a launch
  of one row compiles the same kernel as one of many).
* :func:`attention_kernel`: one program per (query, head) over the keys ``[start, end)`` of that
  query, in blocks of ``BLOCK_N`` starting at ``start`` (so the same keys give the same blocks
  whatever precedes them in the row), online softmax in fp32.
* :func:`row_mean_kernel`, :func:`log_softmax_kernel`: one program per row, a fixed chunking of
  the row into ``BLOCK`` lanes, then one tree reduction of the lanes.

A reduction's order follows the register layout of the tile it sums, which Triton derives from
what it can prove of the pointers' alignment and the strides' divisibility at compile time. The
attention and the row kernels are therefore compiled without those specialisations (their
pointers and strides are never assumed aligned): an engine's view into its logits and the
trainer's contiguous logits get the one layout. The matmul's arithmetic is the dot's, whose
operand layouts do not depend on how the tiles were loaded.

Under Triton's interpreter (CPU tests) the 16-bit products and roundings go through
:func:`~miles_native.kernels.fused_moe_kernels._mma` / ``_cast``, as the GPU computes them.
"""

import triton
import triton.language as tl

from miles_native.kernels.fused_moe_kernels import _cast, _mma


@triton.jit(do_not_specialize=["M"])
def matmul_kernel(
    x_ptr,  # [M, K], row stride stride_xm, unit column stride
    w_ptr,  # [N, K], row stride stride_wn, unit column stride
    b_ptr,  # [N] or a dummy when not HAS_BIAS
    out_ptr,  # [M, N] contiguous, the input dtype
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETER: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + rn[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(x_rows + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(w_cols + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc = _mma(a, b, acc, DOT_PRECISION, INTERPRETER)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out = _cast(acc, out_ptr.dtype.element_ty, INTERPRETER)
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(out_ptr + offs, out, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit(
    do_not_specialize=[
        "Tq", "H", "group", "sq_b", "sq_h", "sq_t", "sk_b", "sk_h", "sk_t",
        "sv_b", "sv_h", "sv_t", "span_b",
    ],
    do_not_specialize_on_alignment=["q_ptr", "k_ptr", "v_ptr", "out_ptr"],
)  # fmt: skip
def attention_kernel(
    q_ptr,  # [B, H, Tq, D] (strides given)
    k_ptr,  # [B, Hkv, Tk, D]
    v_ptr,  # [B, Hkv, Tk, D]
    out_ptr,  # [B, Tq, H, D] contiguous
    start_ptr,  # int32 [Bm, Tq]: first key of each query (Bm is B or 1)
    end_ptr,  # int32 [Bm, Tq]: one past its last key (start == end: no key, zeros)
    Tq,
    H,
    group,
    scale,
    sq_b, sq_h, sq_t,
    sk_b, sk_h, sk_t,
    sv_b, sv_h, sv_t,
    span_b,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRETER: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)  # b * Tq + t
    h = tl.program_id(1)
    b = row // Tq
    t = row % Tq
    start = tl.load(start_ptr + b * span_b + t)
    end = tl.load(end_ptr + b * span_b + t)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    b64 = b.to(tl.int64)
    q = tl.load(q_ptr + b64 * sq_b + h * sq_h + t * sq_t + d, mask=dm, other=0.0).to(tl.float32)
    kvh = h // group
    k_base = k_ptr + b64 * sk_b + kvh * sk_h
    v_base = v_ptr + b64 * sv_b + kvh * sv_h
    m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), axis=0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nm = n < end
        kv_mask = nm[:, None] & dm[None, :]
        k = tl.load(k_base + n[:, None].to(tl.int64) * sk_t + d[None, :], mask=kv_mask, other=0.0)
        s = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * scale
        s = tl.where(nm, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        v = tl.load(v_base + n[:, None].to(tl.int64) * sv_t + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    out = tl.where(l_i > 0, acc / tl.maximum(l_i, 1e-30), 0.0)
    out = _cast(out, out_ptr.dtype.element_ty, INTERPRETER)
    tl.store(out_ptr + (row.to(tl.int64) * H + h) * D + d, out, mask=dm)


@triton.jit(do_not_specialize=["stride_x"], do_not_specialize_on_alignment=["x_ptr"])
def row_mean_kernel(
    x_ptr,  # [R, N], row stride stride_x, unit column stride
    out_ptr,  # [R], the input dtype
    N,
    stride_x,
    BLOCK: tl.constexpr,
    INTERPRETER: tl.constexpr,
):
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride_x
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, N, BLOCK):
        acc += tl.load(base + c0 + cols, mask=c0 + cols < N, other=0.0).to(tl.float32)
    mean = tl.sum(acc, axis=0) / N
    tl.store(out_ptr + row, _cast(mean, out_ptr.dtype.element_ty, INTERPRETER))


@triton.jit(
    do_not_specialize=["stride_x", "stride_t"],
    do_not_specialize_on_alignment=["x_ptr", "temp_ptr", "out_ptr"],
)
def log_softmax_kernel(
    x_ptr,  # [R, V], row stride stride_x, unit column stride (any float dtype)
    temp_ptr,  # fp32 [R] (stride_t 1) or [1] (stride_t 0): the row's temperature
    out_ptr,  # fp32 [R, V] contiguous
    V,
    stride_x,
    stride_t,
    BLOCK: tl.constexpr,
):
    """``log_softmax(x / T)`` of one row in fp32: a max pass, a sum-of-exp pass, a write pass."""
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride_x
    out = out_ptr + row.to(tl.int64) * V
    temp = tl.load(temp_ptr + row * stride_t)
    cols = tl.arange(0, BLOCK)
    run_max = tl.full([BLOCK], float("-inf"), tl.float32)
    for c0 in range(0, V, BLOCK):
        z = tl.load(base + c0 + cols, mask=c0 + cols < V, other=float("-inf")).to(tl.float32)
        run_max = tl.maximum(run_max, z / temp)
    m = tl.max(run_max, axis=0)
    acc = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, V, BLOCK):
        z = tl.load(base + c0 + cols, mask=c0 + cols < V, other=float("-inf")).to(tl.float32)
        acc += tl.exp(z / temp - m)
    log_z = m + tl.log(tl.sum(acc, axis=0))
    for c0 in range(0, V, BLOCK):
        mask = c0 + cols < V
        z = tl.load(base + c0 + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out + c0 + cols, z / temp - log_z, mask=mask)
