"""Triton kernels of ``--true-on-policy`` on a GPU (:mod:`miles_native.kernels.batch_invariant`).

Each output row is computed by one fixed sequence of operations that depends only on the row's
own data and on compile-time constants (block sizes, the reduced length), never on how many
rows the launch carries, where the row sits among them, or padding:

* :func:`matmul_kernel`: ``x @ W.T (+ b)`` with fixed ``BLOCK_M/N/K``, no split-K, the K loop in
  one order, fp32 accumulation, one rounding on store. A tile's dot computes each output element
  from its own row of ``x`` and column of ``W.T`` only (the other rows of the tile do not enter
  it), so a row's bits are those of any tile it lands in. ``M`` is not specialized on (a launch
  of one row compiles the same kernel as one of many).
* :func:`attention_kernel`: one program per tile of ``BLOCK_M`` queries and a head; each query
  over its keys ``[start, end)`` in blocks of ``BLOCK_N`` starting at ``start`` (so the same keys
  give the same blocks whatever precedes them in the row or shares its tile), scores and the
  weighted sum as tile dots (a query's row of a dot is computed from that query alone, as in the
  matmul), online softmax in fp32, the weights rounded to the input dtype for the second dot.
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETER: tl.constexpr,
):  # fmt: skip
    """One program per ``BLOCK_M`` queries of a row and one head. The tile's queries that share
    a first key are computed together (a packed row's tile can hold the ends and starts of
    several samples: one pass per distinct first key), each over its keys in blocks of
    ``BLOCK_N`` counted from that first key, so a query meets the same blocks whatever tile it
    is in; a key past a query's end is masked (weight exactly 0, and a block wholly past it
    leaves the running max, sum and accumulator unchanged)."""
    tiles = tl.cdiv(Tq, BLOCK_M)
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = pid // tiles
    t = (pid % tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    tm = t < Tq
    start = tl.load(start_ptr + b * span_b + t, mask=tm, other=0)
    end = tl.load(end_ptr + b * span_b + t, mask=tm, other=0)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    b64 = b.to(tl.int64)
    q_rows = q_ptr + b64 * sq_b + h * sq_h + t[:, None].to(tl.int64) * sq_t + d[None, :]
    q = tl.load(q_rows, mask=tm[:, None] & dm[None, :], other=0.0)
    kvh = h // group
    k_base = k_ptr + b64 * sk_b + kvh * sk_h
    v_base = v_ptr + b64 * sv_b + kvh * sv_h
    out_rows = out_ptr + ((b64 * Tq + t[:, None]) * H + h) * D + d[None, :]
    empty = tm & (start >= end)  # no key: zeros
    tl.store(out_rows, tl.zeros([BLOCK_M, BLOCK_D], tl.float32).to(out_ptr.dtype.element_ty),
             mask=empty[:, None] & dm[None, :])  # fmt: skip
    done = ~tm | empty
    left = tl.sum((~done).to(tl.int32), axis=0)
    while left > 0:
        first = tl.min(tl.where(done, 2147483647, start), axis=0)
        sel = ~done & (start == first)
        last = tl.max(tl.where(sel, end, 0), axis=0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(first, last, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nm = n < last
            kt = tl.load(k_base + n[None, :].to(tl.int64) * sk_t + d[:, None],
                         mask=nm[None, :] & dm[:, None], other=0.0)  # fmt: skip
            s = _mma(q, kt, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), DOT_PRECISION, INTERPRETER)
            s = tl.where(sel[:, None] & (n[None, :] < end[:, None]), s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # rows not in this pass have no key (-inf): 0 keeps their arithmetic finite; a
            # query of the pass has its first key in the first block, hence a finite max
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            v = tl.load(v_base + n[:, None].to(tl.int64) * sv_t + d[None, :],
                        mask=nm[:, None] & dm[None, :], other=0.0)  # fmt: skip
            acc = _mma(_cast(p, v.dtype, INTERPRETER), v, acc * alpha[:, None],
                       DOT_PRECISION, INTERPRETER)  # fmt: skip
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        out = acc / tl.where(sel, l_i, 1.0)[:, None]
        tl.store(out_rows, _cast(out, out_ptr.dtype.element_ty, INTERPRETER),
                 mask=sel[:, None] & dm[None, :])  # fmt: skip
        done = done | sel
        left = tl.sum((~done).to(tl.int32), axis=0)


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
