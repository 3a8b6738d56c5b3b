"""Triton kernels of the fused MoE expert layer (forward and backward).

Notation (shared with :mod:`miles_native.kernels.fused_moe`):

* ``x [T, H]`` hidden states, ``w1 [E, 2I, H]`` gate+up weights (rows ``[0, I)`` gate,
  ``[I, 2I)`` up), ``w2 [E, H, I]`` down weights, ``topk_ids / topk_weights [T, k]``.
* An *assignment* ``a = t * k + j`` is token ``t``'s ``j``-th routed expert; ``S = T * k``.
* The *aligned* order (:mod:`moe_align`) lists assignments grouped by expert, each expert's
  group padded to a multiple of ``BLOCK_M`` with the sentinel ``S``; ``block_expert[b]`` is the
  expert of row block ``b`` (``-1`` past the last used block); ``P`` is the padded length.
* ``h [P, 2I]`` is the pre-activation ``x @ w1[e].T`` in aligned order (pad rows are zero),
  ``act = p * silu(g) * u`` the routing-weighted activation, with ``g = h[:, :I]``,
  ``u = h[:, I:]`` and ``p`` the assignment's routing weight.

Every kernel accumulates in fp32 and rounds once on store. Offsets that scale with a row index
are computed in int64 so that ``T * k * H`` may exceed 2**31.
"""

import triton
import triton.language as tl


@triton.jit
def _mma(a, b, acc, DOT_PRECISION: tl.constexpr, INTERPRETER: tl.constexpr):
    """``acc + a @ b``. Under the interpreter (whose ``dot`` multiplies the raw bits of bf16)
    the same exact products of the 16-bit values are formed in fp32."""
    if INTERPRETER:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _cast(x, dtype: tl.constexpr, INTERPRETER: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even in ``dtype``, as the GPU does. The interpreter
    truncates fp32 -> bf16, so there the rounding increment is added to the bits first."""
    if INTERPRETER:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def moe_align_kernel(
    order_ptr,  # [S] assignment ids sorted (stably) by expert
    counts_ptr,  # [E] assignments per expert
    starts_ptr,  # [E] exclusive prefix sum of counts
    pstarts_ptr,  # [E + 1] exclusive prefix sum of block-padded counts
    sorted_ids_ptr,  # out [P_max], prefilled with the sentinel S
    block_expert_ptr,  # out [P_max // BLOCK_M], prefilled with -1
    num_assignments,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per expert: copy its sorted assignments into its padded slot range."""
    e = tl.program_id(0)
    count = tl.load(counts_ptr + e)
    start = tl.load(starts_ptr + e)
    pstart = tl.load(pstarts_ptr + e)
    pend = tl.load(pstarts_ptr + e + 1)
    for j0 in range(0, pend - pstart, BLOCK):
        offs = j0 + tl.arange(0, BLOCK)
        src = tl.load(order_ptr + start + offs, mask=offs < count, other=num_assignments)
        tl.store(sorted_ids_ptr + pstart + offs, src, mask=offs < pend - pstart)
    for b0 in range(pstart // BLOCK_M, pend // BLOCK_M, BLOCK):
        offs_b = b0 + tl.arange(0, BLOCK)
        expert = tl.zeros([BLOCK], dtype=tl.int32) + e
        tl.store(block_expert_ptr + offs_b, expert, mask=offs_b < pend // BLOCK_M)


@triton.jit
def gate_up_fwd_kernel(
    x_ptr,
    w1_ptr,
    h_ptr,  # out [P, 2I]
    act_ptr,  # out [P, I]: p * silu(g) * u
    weights_ptr,  # [S] routing weights
    sorted_ids_ptr,
    block_expert_ptr,
    num_assignments,
    hidden,
    inter,
    stride_xt,
    stride_xh,
    stride_we,
    stride_wn,
    stride_wk,
    stride_hm,
    stride_am,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETER: tl.constexpr,
):
    """``h[r] = x[tok(r)] @ w1[e].T`` (gate and up columns together) and the routing-weighted
    activation ``act[r] = p * silu(g) * u`` with ``p = weights[a(r)]`` (0 on pad rows)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(inter, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assignment = tl.load(sorted_ids_ptr + offs_m)
    row_valid = assignment < num_assignments
    token = (assignment // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :] * stride_xh
    w_base = w1_ptr + expert.to(tl.int64) * stride_we
    wg_ptrs = w_base + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    wu_ptrs = wg_ptrs + inter * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = offs_k < hidden - k0
        xa = tl.load(x_ptrs, mask=row_valid[:, None] & k_mask[None, :], other=0.0)
        wg = tl.load(wg_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        wu = tl.load(wu_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc_g = _mma(xa, wg, acc_g, DOT_PRECISION, INTERPRETER)
        acc_u = _mma(xa, wu, acc_u, DOT_PRECISION, INTERPRETER)
        x_ptrs += BLOCK_K * stride_xh
        wg_ptrs += BLOCK_K * stride_wk
        wu_ptrs += BLOCK_K * stride_wk

    out_dtype = h_ptr.dtype.element_ty
    gate = _cast(acc_g, out_dtype, INTERPRETER)
    up = _cast(acc_u, out_dtype, INTERPRETER)
    # The activation is computed from the rounded pre-activations, as the backward recomputes it.
    gate_f = gate.to(tl.float32)
    p = tl.load(weights_ptr + assignment, mask=row_valid, other=0.0).to(tl.float32)
    act = gate_f * tl.sigmoid(gate_f) * up.to(tl.float32) * p[:, None]
    rows = offs_m.to(tl.int64)
    h_ptrs = h_ptr + rows[:, None] * stride_hm + offs_n[None, :]
    tl.store(h_ptrs, gate, mask=n_mask[None, :])
    tl.store(h_ptrs + inter, up, mask=n_mask[None, :])
    act_ptrs = act_ptr + rows[:, None] * stride_am + offs_n[None, :]
    tl.store(act_ptrs, _cast(act, out_dtype, INTERPRETER), mask=n_mask[None, :])


@triton.jit
def grouped_gemm_scatter_kernel(
    a_ptr,  # [P, K] rows in aligned order
    b_ptr,  # [E, N, K] addressed through strides
    c_ptr,  # out [S, N] rows by assignment
    sorted_ids_ptr,
    block_expert_ptr,
    num_assignments,
    n_dim,
    k_dim,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETER: tl.constexpr,
):
    """``c[a(r)] = a[r] @ b[e].T`` for the valid rows ``r`` (``b[e]`` read as ``[N, K]``)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(n_dim, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assignment = tl.load(sorted_ids_ptr + offs_m)
    row_valid = assignment < num_assignments
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_dim
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_base = b_ptr + expert.to(tl.int64) * stride_be
    b_ptrs = b_base + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k_mask = offs_k < k_dim - k0
        a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = _mma(a, b, acc, DOT_PRECISION, INTERPRETER)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + assignment.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(
        c_ptrs,
        _cast(acc, c_ptr.dtype.element_ty, INTERPRETER),
        mask=row_valid[:, None] & n_mask[None, :],
    )


@triton.jit
def down_bwd_kernel(
    dy_ptr,  # [T, H] gradient of the layer output
    w2_ptr,  # [E, H, I]
    h_ptr,  # [P, 2I] saved pre-activations
    weights_ptr,  # [S] routing weights
    dh_ptr,  # out [P, 2I] gradient of h
    dw_partial_ptr,  # out [S, num_n] fp32 partial routing-weight gradients
    sorted_ids_ptr,
    block_expert_ptr,
    num_assignments,
    hidden,
    inter,
    stride_dyt,
    stride_dyh,
    stride_we,
    stride_wh,
    stride_wi,
    stride_hm,
    stride_dhm,
    stride_pm,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETER: tl.constexpr,
):
    """Backward through the down projection, the routing weight and SiLU-and-mul.

    With ``z[r] = dy[tok(r)] @ w2[e]`` (the gradient of ``act`` before the routing weight
    ``p = weights[a(r)]``): ``d_act = p * z``, ``dg = d_act * u * s * (1 + g * (1 - s))`` with
    ``s = sigmoid(g)``, ``du = d_act * g * s``, and ``d_p = sum_i z_i * act_i`` (this program's
    share over its ``BLOCK_N`` columns goes to ``dw_partial[a, pid_n]``).
    """
    pid = tl.program_id(0)
    num_n = tl.cdiv(inter, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assignment = tl.load(sorted_ids_ptr + offs_m)
    row_valid = assignment < num_assignments
    token = (assignment // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)

    dy_ptrs = dy_ptr + token[:, None] * stride_dyt + offs_k[None, :] * stride_dyh
    w_base = w2_ptr + expert.to(tl.int64) * stride_we
    w_ptrs = w_base + offs_n[None, :] * stride_wi + offs_k[:, None].to(tl.int64) * stride_wh
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = offs_k < hidden - k0
        dy = tl.load(dy_ptrs, mask=row_valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = _mma(dy, w, acc, DOT_PRECISION, INTERPRETER)
        dy_ptrs += BLOCK_K * stride_dyh
        w_ptrs += BLOCK_K * stride_wh

    rows = offs_m.to(tl.int64)
    h_ptrs = h_ptr + rows[:, None] * stride_hm + offs_n[None, :]
    gate = tl.load(h_ptrs, mask=n_mask[None, :], other=0.0).to(tl.float32)
    up = tl.load(h_ptrs + inter, mask=n_mask[None, :], other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    act = _cast(silu * up, dh_ptr.dtype.element_ty, INTERPRETER).to(tl.float32)
    dw_part = tl.sum(acc * act, axis=1)
    p_ptrs = dw_partial_ptr + assignment.to(tl.int64) * stride_pm + pid_n
    tl.store(p_ptrs, dw_part, mask=row_valid)

    p = tl.load(weights_ptr + assignment, mask=row_valid, other=0.0).to(tl.float32)
    d_act = acc * p[:, None]
    d_gate = d_act * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = d_act * silu
    out_dtype = dh_ptr.dtype.element_ty
    dh_ptrs = dh_ptr + rows[:, None] * stride_dhm + offs_n[None, :]
    tl.store(dh_ptrs, _cast(d_gate, out_dtype, INTERPRETER), mask=n_mask[None, :])
    tl.store(dh_ptrs + inter, _cast(d_up, out_dtype, INTERPRETER), mask=n_mask[None, :])


@triton.jit
def expert_weight_grad_kernel(
    l_ptr,  # [T, M] per-token left operand (x or dy), gathered by token
    r_ptr,  # [P, N] right operand in aligned order (dh or act)
    out_ptr,  # out [E, M, N] through strides
    sorted_ids_ptr,
    pstarts_ptr,  # [E + 1] padded group offsets
    num_assignments,
    m_dim,
    n_dim,
    stride_lt,
    stride_lm,
    stride_rp,
    stride_rn,
    stride_oe,
    stride_om,
    stride_on,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETER: tl.constexpr,
):
    """``out[e] = sum_{r in group(e)} l[tok(r)]^T r[r]`` over the expert's aligned rows.

    Grid ``(tiles, E)`` with the tile index fastest, so the programs running together share one
    expert's rows in L2. Experts without tokens get zeros. Rows are visited in aligned order,
    so the result is deterministic.
    """
    pid = tl.program_id(0)
    expert = tl.program_id(1)
    num_n = tl.cdiv(n_dim, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    pstart = tl.load(pstarts_ptr + expert)
    pend = tl.load(pstarts_ptr + expert + 1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < m_dim
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_dim

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(pstart, pend, BLOCK_K):
        offs_r = r0 + tl.arange(0, BLOCK_K)
        r_mask = offs_r < pend
        assignment = tl.load(sorted_ids_ptr + offs_r, mask=r_mask, other=num_assignments)
        valid = assignment < num_assignments
        token = (assignment // TOP_K).to(tl.int64)
        l_ptrs = l_ptr + token[None, :] * stride_lt + offs_m[:, None] * stride_lm
        lt = tl.load(l_ptrs, mask=valid[None, :] & m_mask[:, None], other=0.0)
        r_ptrs = r_ptr + offs_r.to(tl.int64)[:, None] * stride_rp + offs_n[None, :] * stride_rn
        rt = tl.load(r_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc = _mma(lt, rt, acc, DOT_PRECISION, INTERPRETER)

    o_ptrs = (
        out_ptr
        + expert.to(tl.int64) * stride_oe
        + offs_m[:, None].to(tl.int64) * stride_om
        + offs_n[None, :] * stride_on
    )
    tl.store(
        o_ptrs,
        _cast(acc, out_ptr.dtype.element_ty, INTERPRETER),
        mask=m_mask[:, None] & n_mask[None, :],
    )


@triton.jit
def topk_sum_kernel(
    y_ptr,  # [T * k, H]
    out_ptr,  # [T, H]
    hidden,
    stride_ym,
    stride_ot,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERPRETER: tl.constexpr,
):
    """``out[t] = sum_j y[t * k + j]``, accumulated in fp32 in ``j`` order (deterministic)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + j) * stride_ym + offs, mask=mask, other=0.0).to(
            tl.float32
        )
    tl.store(
        out_ptr + t * stride_ot + offs, _cast(acc, out_ptr.dtype.element_ty, INTERPRETER), mask=mask
    )
