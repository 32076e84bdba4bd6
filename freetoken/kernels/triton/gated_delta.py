"""Gated DeltaNet decode kernels: the conv-state step, the recurrent step of the gated delta
rule and the gated RMSNorm, each one kernel (layers/gated_delta.py is their reference).

At one token a step the layer's torch code is some forty small kernels; these read and
write each sequence's state in the pool in place, found through its slot on the device, so
a decode step stays free of host work and can be captured as a graph.
"""

import triton
import triton.language as tl


@triton.jit
def conv1d_step_kernel(
    x_ptr, w_ptr, state_ptr, slots_ptr, out_ptr, C, x_stride,
    K: tl.constexpr, KB: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """x [B, C] (rows x_stride apart), w [C, K], state [N, C, K-1] -> out [B, C]: SiLU of
    the depthwise conv over each channel's last K-1 inputs and x; the state moves on."""
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = offs_c < C
    j = tl.arange(0, KB)
    st = state_ptr + slot * C * (K - 1) + offs_c[:, None] * (K - 1) + j[None, :]
    win = tl.load(st, mask=mc[:, None] & (j[None, :] < K - 1), other=0.0).to(tl.float32)
    x = tl.load(x_ptr + b * x_stride + offs_c, mask=mc, other=0.0)
    win = tl.where(j[None, :] == K - 1, x.to(tl.float32)[:, None], win)
    w = tl.load(w_ptr + offs_c[:, None] * K + j[None, :], mask=mc[:, None] & (j[None, :] < K))
    y = tl.sum(win * w.to(tl.float32), axis=1)
    y = y * tl.sigmoid(y)
    tl.store(out_ptr + b * C + offs_c, y.to(out_ptr.dtype.element_ty), mask=mc)
    # the new state is the window shifted by one: read again one place on, then x last
    nxt = tl.load(st + 1, mask=mc[:, None] & (j[None, :] < K - 2), other=0.0)
    nxt = tl.where(j[None, :] == K - 2, x[:, None], nxt)
    tl.store(st, nxt.to(state_ptr.dtype.element_ty), mask=mc[:, None] & (j[None, :] < K - 1))


@triton.jit
def _l2norm(x, axis: tl.constexpr):
    return x / tl.sqrt(tl.sum(x * x, axis=axis, keep_dims=True) + 1e-6)


@triton.jit
def _softplus(x):
    # torch's softplus: x itself above 20, where exp would only round to it
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def recurrent_step_kernel(
    qkv_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, slots_ptr, out_ptr,
    qkv_stride, ab_stride, HK, HV, scale,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """One token of sequence b, value head h, values [v0, v0 + BV): q|k|v [B, C] rows
    qkv_stride apart, a/b [B, HV] rows ab_stride apart; state [N, HV, DK, DV] fp32 at the
    sequence's slot, updated in place; out [B, HV, DV]."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    hk = h // (HV // HK)
    dt = out_ptr.dtype.element_ty
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    mk, mv = offs_k < DK, offs_v < DV
    row = qkv_ptr + b * qkv_stride
    q = tl.load(row + hk * DK + offs_k, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(row + (HK + hk) * DK + offs_k, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(row + 2 * HK * DK + h * DV + offs_v, mask=mv, other=0.0).to(tl.float32)
    q = _l2norm(q, 0) * scale
    k = _l2norm(k, 0)
    a = tl.load(a_ptr + b * ab_stride + h).to(tl.float32)
    a += tl.load(dt_bias_ptr + h).to(tl.float32)
    g = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32)) * _softplus(a)
    # β = σ(b) in the activations' dtype, as the reference computes it
    beta = tl.sigmoid(tl.load(b_ptr + b * ab_stride + h).to(tl.float32)).to(dt).to(tl.float32)
    at = state_ptr + (slot * HV + h) * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    m = mk[:, None] & mv[None, :]
    S = tl.load(at, mask=m, other=0.0) * tl.exp(g)  # [BK, BV]
    delta = (v - tl.sum(S * k[:, None], axis=0)) * beta
    S += k[:, None] * delta[None, :]
    tl.store(at, S, mask=m)
    o = tl.sum(S * q[:, None], axis=0)
    tl.store(out_ptr + (b * HV + h) * DV + offs_v, o.to(dt), mask=mv)


@triton.jit
def gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, D, eps, BLOCK: tl.constexpr):
    """Each row of x [R, D]: RMS-normalised (rounded to the dtype), times w (rounded), times
    SiLU of the same row of z; the reference's roundings."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < D
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * D + offs, mask=m, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    h = (w * (x * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    z = tl.load(z_ptr + row * D + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + offs, (h * z * tl.sigmoid(z)).to(dt), mask=m)
