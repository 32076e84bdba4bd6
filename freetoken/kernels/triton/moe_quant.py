"""Routed experts for small batches over a slot pool of packed experts, decoded in registers.

moe_decode.py's kernels with the weights read a step of whole blocks at a time through
`quant.unpack` and dotted by `quant.dot`: one program per (route, row tile), routes whose
slot is negative skipped (the CPU serves them). A slot holds its expert's bytes from its
first byte and is SLOT bytes long (a pool fits the widest layer's format). Shapes: x [T, H],
slots/weights [T*k], h [T*k, I] (fp32), out [T*k, H] (fp32, weighted per route); biases
[S, 2I] and [S, H] in float. FMT_* are the formats' codes (0: float weights).

And `dequant_kernel`: one slot's matrix decoded into a float scratch, for prefill chunks,
whose many tokens per expert make a decoded copy and a matmul the better shape.
"""

import triton
import triton.language as tl

from freetoken.kernels.triton.moe_decode import _activate
from freetoken.kernels.triton.quant import (
    STEP,
    dot,
    row_ptrs,
    step_x,
    total,
    unpack,
    weights,
    zeros,
)


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
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
):
    r = tl.program_id(0)
    slot = tl.load(slot_ptr + r)
    if slot < 0:
        return
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_i = offs_i < I
    base = gu_ptr + slot.to(tl.int64) * SLOT
    gate = row_ptrs(base, offs_i, H, FMT, QB, QBYTES)
    up = row_ptrs(base, offs_i + I, H, FMT, QB, QBYTES)
    xp = x_ptr + (r // K) * H
    part_g = zeros(BLOCK_I, FMT)
    part_u = zeros(BLOCK_I, FMT)
    for kb in range(0, (H + STEP - 1) // STEP):
        vg, ag, bg, col = unpack(gate, kb, mask_i, H, FMT, QBYTES)
        vu, au, bu, _ = unpack(up, kb, mask_i, H, FMT, QBYTES)
        xv = step_x(xp, kb, col, H)
        part_g += dot(vg, ag, bg, xv, FMT)
        part_u += dot(vu, au, bu, xv, FMT)
    acc_g = total(part_g)
    acc_u = total(part_u)
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
    HAS_BIAS: tl.constexpr,
):
    r = tl.program_id(0)
    slot = tl.load(slot_ptr + r)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    if slot < 0:  # served elsewhere: its rows of out are zeros (out is not cleared first)
        tl.store(out_ptr + r * H + offs_h, tl.zeros([BLOCK_H], tl.float32), mask=mask_h)
        return
    rows = row_ptrs(dn_ptr + slot.to(tl.int64) * SLOT, offs_h, I, FMT, QB, QBYTES)
    part = zeros(BLOCK_H, FMT)
    for kb in range(0, (I + STEP - 1) // STEP):
        v, a, b, col = unpack(rows, kb, mask_h, I, FMT, QBYTES)
        part += dot(v, a, b, step_x(h_ptr + r * I, kb, col, I), FMT)
    acc = total(part)
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
):
    """dst [ROWS, COLS] (any float dtype) = the packed matrix at src decoded, a program per
    (row tile, step). Launched without fused multiply-adds, its weights are bit for bit the
    reference's (kernels/reference.py rounds d·q and the min term apart)."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < ROWS
    kb = tl.program_id(1)
    rows = row_ptrs(src_ptr, offs_r, COLS, FMT, QB, QBYTES)
    v, a, b, col = unpack(rows, kb, mask_r, COLS, FMT, QBYTES)
    w = weights(v, a, b, FMT)
    c = kb * STEP + col
    dst = dst_ptr + offs_r.to(tl.int64)[:, None, None, None] * COLS + c
    m = mask_r[:, None, None, None] & (c < COLS)
    tl.store(dst, w.to(dst_ptr.dtype.element_ty), mask=m)
