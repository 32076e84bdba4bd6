"""The chunked gated delta rule of a prefill (layers/gated_delta.py's `chunk_rule` is the
reference and has the math), in two kernels.

`chunk_prepare_kernel`, one program per (chunk, value head), all chunks at once: the
cumulative decay Γ inside the chunk, the inverse of the chunk's unit lower-triangular
system (I + A) by forward substitution, and from it W_k = (I + A)⁻¹·diag(βe^Γ)K and
W_v = (I + A)⁻¹·βV, which depend on the chunk alone.

`chunk_state_kernel`, one program per (value head, block of value columns), walks the
chunks in order carrying the state S: the corrections U = W_v − W_k·S, the chunk's
outputs e^Γ·Q·S + (QKᵀ ⊙ decay)·U and the state leaving it, e^{Γ_C}S + (K ⊙ e^{Γ_C−Γ})ᵀU.

Scratch rows are padded to whole chunks: a padded row has k = v = β = 0 and g = 0, so it
changes neither the state nor Γ, and Γ's last row is the chunk's total decay.
"""

import triton
import triton.language as tl


@triton.jit
def _rows_of(ptr, t, stride, col0, offs, T, D):
    """[C, len(offs)] fp32: rows t (stride apart) of columns col0 + offs, zero past T / D."""
    m = (t[:, None] < T) & (offs[None, :] < D)
    return tl.load(ptr + t[:, None] * stride + col0 + offs[None, :], mask=m, other=0.0).to(
        tl.float32
    )


@triton.jit
def _unit_norm(x):
    return x / tl.sqrt(tl.sum(x * x, axis=1, keep_dims=True) + 1e-6)


@triton.jit
def chunk_prepare_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, cum_ptr, wk_ptr, wv_ptr,
    T, k_stride, v_stride, HK, HV,
    C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """k [T, HK, DK] and v [T, HV, DV] (rows k_stride / v_stride apart), g/beta [T, HV] fp32
    -> cum [Tp, HV], wk [Tp, HV, DK], wv [Tp, HV, DV] fp32 (Tp: T padded to chunks)."""
    h = tl.program_id(1)
    hk = h // (HV // HK)
    t = tl.program_id(0) * C + tl.arange(0, C)
    offs_k, offs_v = tl.arange(0, BK), tl.arange(0, BV)
    K = _unit_norm(_rows_of(k_ptr, t, k_stride, hk * DK, offs_k, T, DK))
    g = tl.load(g_ptr + t * HV + h, mask=t < T, other=0.0)
    beta = tl.load(beta_ptr + t * HV + h, mask=t < T, other=0.0)
    G = tl.cumsum(g, axis=0)
    tl.store(cum_ptr + t * HV + h, G)
    rows, cols = tl.arange(0, C)[:, None], tl.arange(0, C)[None, :]
    below = rows > cols
    kk = tl.dot(K, tl.trans(K), input_precision=PRECISION)
    decay = tl.exp(tl.where(below, G[:, None] - G[None, :], 0.0))
    A = tl.where(below, beta[:, None] * decay * kk, 0.0)
    # (I + A)⁻¹ row by row: row i = e_i − Σ_{s<i} A[i, s]·row s, the rows above already final
    inv = tl.where(rows == cols, 1.0, 0.0)
    for i in range(1, C):
        a_i = tl.sum(tl.where(rows == i, A, 0.0), axis=0)  # A[i, :]
        inv -= tl.where(rows == i, tl.sum(a_i[:, None] * inv, axis=0)[None, :], 0.0)
    wk = tl.dot(inv, K * (beta * tl.exp(G))[:, None], input_precision=PRECISION)
    tl.store(wk_ptr + (t[:, None] * HV + h) * DK + offs_k[None, :], wk, mask=offs_k[None, :] < DK)
    V = _rows_of(v_ptr, t, v_stride, h * DV, offs_v, T, DV)
    wv = tl.dot(inv, V * beta[:, None], input_precision=PRECISION)
    tl.store(wv_ptr + (t[:, None] * HV + h) * DV + offs_v[None, :], wv, mask=offs_v[None, :] < DV)


@triton.jit
def chunk_state_kernel(
    q_ptr, k_ptr, cum_ptr, wk_ptr, wv_ptr, state_ptr, out_ptr,
    T, n_chunks, q_stride, k_stride, HK, HV, scale,
    C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Value head h, value columns [v0, v0 + BV): from state [HV, DK, DV] fp32 (updated in
    place) through every chunk; out [T, HV, DV]."""
    h = tl.program_id(0)
    hk = h // (HV // HK)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    mk, mv = offs_k < DK, offs_v < DV
    at = state_ptr + h * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    S = tl.load(at, mask=mk[:, None] & mv[None, :], other=0.0)  # [BK, BV]
    rows, cols = tl.arange(0, C)[:, None], tl.arange(0, C)[None, :]
    c = 0
    while c < n_chunks:  # a runtime bound that Triton's interpreter also runs
        t = c * C + tl.arange(0, C)
        Q = _unit_norm(_rows_of(q_ptr, t, q_stride, hk * DK, offs_k, T, DK)) * scale
        K = _unit_norm(_rows_of(k_ptr, t, k_stride, hk * DK, offs_k, T, DK))
        G = tl.load(cum_ptr + t * HV + h)
        W = tl.load(
            wk_ptr + (t[:, None] * HV + h) * DK + offs_k[None, :], mask=mk[None, :], other=0.0
        )
        U = tl.load(
            wv_ptr + (t[:, None] * HV + h) * DV + offs_v[None, :], mask=mv[None, :], other=0.0
        )
        U -= tl.dot(W, S, input_precision=PRECISION)
        seen = rows >= cols
        qk = tl.dot(Q, tl.trans(K), input_precision=PRECISION)
        qk *= tl.where(seen, tl.exp(tl.where(seen, G[:, None] - G[None, :], 0.0)), 0.0)
        o = tl.dot(Q * tl.exp(G)[:, None], S, input_precision=PRECISION)
        o += tl.dot(qk, U, input_precision=PRECISION)
        m = (t[:, None] < T) & mv[None, :]
        o = o.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + (t[:, None] * HV + h) * DV + offs_v[None, :], o, mask=m)
        last = tl.min(G, axis=0)  # Γ never rises: its last row is its least
        tail = K * tl.exp(last - G)[:, None]
        S = S * tl.exp(last) + tl.dot(tl.trans(tail), U, input_precision=PRECISION)
        c += 1
    tl.store(at, S, mask=mk[:, None] & mv[None, :])
