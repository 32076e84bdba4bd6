"""Routed experts for small batches over a slot pool of packed experts, decoded on the fly.

moe_decode.py's kernels with each weight tile read through `quant.weights`: one program per
(route, row tile), routes whose slot is negative skipped (the CPU serves them). A slot holds
its expert's bytes from its first byte and is SLOT bytes long (a pool fits the widest layer's
format). Shapes: x [T, H], slots/weights [T*k], h [T*k, I] (fp32), out [T*k, H] (fp32,
weighted per route); biases [S, 2I] and [S, H] in float. FMT_* are the formats' codes.

And `dequant_kernel`: one slot's matrix decoded into a float scratch, for prefill chunks,
whose many tokens per expert make a decoded copy and a matmul the better shape.
"""

import triton
import triton.language as tl

from freetoken.kernels.triton.moe_decode import _activate
from freetoken.kernels.triton.quant import weights


@triton.jit
def gate_up_q_kernel(
    x_ptr,
    gu_ptr,
    bias_ptr,
    slot_ptr,
    h_ptr,
    alpha,
    limit,
    H: tl.constexpr,
    I: tl.constexpr,
    K: tl.constexpr,
    SLOT: tl.constexpr,
    FMT: tl.constexpr,
    QB: tl.constexpr,
    QBYTES: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
):
    r = tl.program_id(0)
    slot = tl.load(slot_ptr + r)
    if slot < 0:
        return
    t = r // K
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_i = offs_i < I
    base = gu_ptr + slot.to(tl.int64) * SLOT
    acc_g = tl.zeros([BLOCK_I], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        xv = tl.load(x_ptr + t * H + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        m = mask_i[:, None] & mask_h[None, :]
        wg = weights(base, offs_i, offs_h, m, H, FMT, QB, QBYTES)
        wu = weights(base, offs_i + I, offs_h, m, H, FMT, QB, QBYTES)
        acc_g += tl.sum(wg * xv[None, :], axis=1)
        acc_u += tl.sum(wu * xv[None, :], axis=1)
    if HAS_BIAS:
        b = bias_ptr + slot.to(tl.int64) * (2 * I)
        acc_g += tl.load(b + offs_i, mask=mask_i, other=0.0).to(tl.float32)
        acc_u += tl.load(b + I + offs_i, mask=mask_i, other=0.0).to(tl.float32)
    h = _activate(acc_g, acc_u, alpha, limit, ACT)
    tl.store(h_ptr + r * I + offs_i, h, mask=mask_i)


@triton.jit
def down_q_kernel(
    h_ptr,
    dn_ptr,
    bias_ptr,
    slot_ptr,
    w_ptr,
    out_ptr,
    H: tl.constexpr,
    I: tl.constexpr,
    SLOT: tl.constexpr,
    FMT: tl.constexpr,
    QB: tl.constexpr,
    QBYTES: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_I: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    r = tl.program_id(0)
    slot = tl.load(slot_ptr + r)
    if slot < 0:
        return
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    base = dn_ptr + slot.to(tl.int64) * SLOT
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for i0 in range(0, I, BLOCK_I):
        offs_i = i0 + tl.arange(0, BLOCK_I)
        mask_i = offs_i < I
        hv = tl.load(h_ptr + r * I + offs_i, mask=mask_i, other=0.0)
        wd = weights(base, offs_h, offs_i, mask_h[:, None] & mask_i[None, :], I, FMT, QB, QBYTES)
        acc += tl.sum(wd * hv[None, :], axis=1)
    if HAS_BIAS:
        b = bias_ptr + slot.to(tl.int64) * H
        acc += tl.load(b + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    wr = tl.load(w_ptr + r).to(tl.float32)
    tl.store(out_ptr + r * H + offs_h, acc * wr, mask=mask_h)


@triton.jit
def dequant_kernel(
    src_ptr,
    dst_ptr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    FMT: tl.constexpr,
    QB: tl.constexpr,
    QBYTES: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """dst [ROWS, COLS] (any float dtype) = the packed matrix at src decoded."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (offs_r < ROWS)[:, None] & (offs_c < COLS)[None, :]
    w = weights(src_ptr, offs_r, offs_c, m, COLS, FMT, QB, QBYTES)
    dst = dst_ptr + offs_r[:, None].to(tl.int64) * COLS + offs_c[None, :]
    tl.store(dst, w.to(dst_ptr.dtype.element_ty), mask=m)
