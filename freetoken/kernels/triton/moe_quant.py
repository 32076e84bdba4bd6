"""Routed experts for small batches over a slot pool of packed experts, decoded in registers.

moe_decode.py's kernels with the weights read a step of whole blocks at a time through
`quant.unpack` and dotted by `quant.dot`: one program per (route, row tile), routes whose
slot is negative skipped (the CPU serves them). A slot holds its expert's bytes from its
first byte and is SLOT bytes long (a pool fits the widest layer's format). Shapes: x [T, H],
slots/weights [T*k], h [T*k, I] (fp32), out [T*k, H] (fp32, weighted per route); biases
[S, 2I] and [S, H] in float. FMT_* are the formats' codes (0: float weights).

With FILL, misses are fetched as moe_decode.py's kernels fetch them (its docstring): a route
whose slot the books fill this step reads its expert from the host banks, and the route first
to it copies the bytes of its program's rows into the slot, then, past a barrier, reads them
there, so the expert crosses PCIe once. A program's rows are one contiguous span of the
expert's bytes, copied WORD bytes at a time (0: in the bank's own elements, a float bank).

And `dequant_kernel`: one slot's matrix decoded into a float scratch, for prefill chunks,
whose many tokens per expert make a decoded copy and a matmul the better shape.
"""

import triton
import triton.language as tl

from freetoken.kernels.triton.moe_decode import _activate, _filled_now
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
    host_ptr,
    host_bias_ptr,
    ids_ptr,
    fill_ptr,
    host_stride,
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
    FILL: tl.constexpr,
    ROUTES: tl.constexpr,
    WORD: tl.constexpr,
):
    """FILL: a route whose slot is filled this step reads the host banks (`host_ptr`, an
    expert every `host_stride` elements, by its expert in `ids_ptr`), the first route to it
    (`fill_ptr`) copying its rows into the slot and reading them there. ROUTES: a power of
    two at least the routes."""
    ROW: tl.constexpr = _row_len(H, FMT, QB, QBYTES)
    r = tl.program_id(0)
    slot = tl.load(slot_ptr + r)
    if slot < 0:
        return
    i0 = tl.program_id(1) * BLOCK_I
    offs_i = i0 + tl.arange(0, BLOCK_I)
    mask_i = offs_i < I
    base = gu_ptr + slot.to(tl.int64) * SLOT
    bias = bias_ptr + slot.to(tl.int64) * (2 * I)
    if FILL:
        base, bias = _filled(
            *(base, bias, slot, r, i0, host_ptr, host_bias_ptr, ids_ptr, fill_ptr, host_stride),
            *(BLOCK_I, I, ROW, 2, HAS_BIAS, ROUTES, WORD),
        )
    acc_g, acc_u = _gate_up_dots(
        base, offs_i, mask_i, x_ptr + (r // K) * H, *(H, I, FMT, QB, QBYTES, BLOCK_I)
    )
    if HAS_BIAS:
        acc_g += tl.load(bias + offs_i, mask=mask_i, other=0.0).to(tl.float32)
        acc_u += tl.load(bias + I + offs_i, mask=mask_i, other=0.0).to(tl.float32)
    h = _activate(acc_g, acc_u, alpha, limit, ACT)
    tl.store(h_ptr + r * I + offs_i, h, mask=mask_i)


@triton.jit
def _gate_up_dots(
    base,
    offs_i,
    mask_i,
    xp,
    H: tl.constexpr,
    I: tl.constexpr,
    FMT: tl.constexpr,
    QB: tl.constexpr,
    QBYTES: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    """The gate and up rows `offs_i` of the expert at `base` dotted with the token's x at
    `xp`: ([BLOCK_I], [BLOCK_I]) in fp32."""
    gate = row_ptrs(base, offs_i, H, FMT, QB, QBYTES)
    up = row_ptrs(base, offs_i + I, H, FMT, QB, QBYTES)
    part_g = zeros(BLOCK_I, FMT)
    part_u = zeros(BLOCK_I, FMT)
    for kb in range(0, (H + STEP - 1) // STEP):
        vg, ag, bg, col = unpack(gate, kb, mask_i, H, FMT, QBYTES)
        vu, au, bu, _ = unpack(up, kb, mask_i, H, FMT, QBYTES)
        xv = step_x(xp, kb, col, H)
        part_g += dot(vg, ag, bg, xv, FMT)
        part_u += dot(vu, au, bu, xv, FMT)
    return total(part_g), total(part_u)


@triton.jit
def down_q_kernel(
    h_ptr,
    dn_ptr,
    bias_ptr,
    slot_ptr,
    w_ptr,
    out_ptr,
    host_ptr,
    host_bias_ptr,
    ids_ptr,
    fill_ptr,
    host_stride,
    H: tl.constexpr,
    I: tl.constexpr,
    SLOT: tl.constexpr,
    FMT: tl.constexpr,
    QB: tl.constexpr,
    QBYTES: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FILL: tl.constexpr,
    ROUTES: tl.constexpr,
    WORD: tl.constexpr,
):
    """FILL as gate_up_q_kernel's, the down bias filled too."""
    r = tl.program_id(0)
    slot = tl.load(slot_ptr + r)
    h0 = tl.program_id(1) * BLOCK_H
    offs_h = h0 + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    if slot < 0:  # served elsewhere: its rows of out are zeros (out is not cleared first)
        tl.store(out_ptr + r * H + offs_h, tl.zeros([BLOCK_H], tl.float32), mask=mask_h)
        return
    base = dn_ptr + slot.to(tl.int64) * SLOT
    bias = bias_ptr + slot.to(tl.int64) * H
    if FILL:
        base, bias = _filled(
            *(base, bias, slot, r, h0, host_ptr, host_bias_ptr, ids_ptr, fill_ptr, host_stride),
            *(BLOCK_H, H, _row_len(I, FMT, QB, QBYTES), 1, HAS_BIAS, ROUTES, WORD),
        )
    rows = row_ptrs(base, offs_h, I, FMT, QB, QBYTES)
    part = zeros(BLOCK_H, FMT)
    for kb in range(0, (I + STEP - 1) // STEP):
        v, a, b, col = unpack(rows, kb, mask_h, I, FMT, QBYTES)
        part += dot(v, a, b, step_x(h_ptr + r * I, kb, col, I), FMT)
    acc = total(part)
    if HAS_BIAS:
        acc += tl.load(bias + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    wr = tl.load(w_ptr + r).to(tl.float32)
    tl.store(out_ptr + r * H + offs_h, acc * wr, mask=mask_h)


@triton.jit
def _filled(
    base,
    bias,
    slot,
    r,
    r0,
    host_ptr,
    host_bias_ptr,
    ids_ptr,
    fill_ptr,
    host_stride,
    R: tl.constexpr,
    ROWS: tl.constexpr,
    ROW: tl.constexpr,
    PARTS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUTES: tl.constexpr,
    WORD: tl.constexpr,
):
    """Where route r's program reads its rows from r0 on (R rows of each of the PARTS
    matrices of ROWS rows a bank stacks): its slot's `base` and `bias`, unless the books
    fill that slot this step. Then the host's, or, for the route first to it, the slot's
    once it has copied them there."""
    if _filled_now(fill_ptr, slot, tl.num_programs(0), ROUTES):
        e = tl.load(ids_ptr + r).to(tl.int64)
        src = host_ptr + e * host_stride
        src_bias = host_bias_ptr + e * (PARTS * ROWS)
        if tl.load(fill_ptr + r) >= 0:
            for p in tl.static_range(PARTS):
                at = p * ROWS * ROW
                _copy_rows(src + at, base + at, r0, R, ROWS, ROW, WORD)
                if HAS_BIAS:
                    _copy_rows(src_bias + p * ROWS, bias + p * ROWS, r0, R, ROWS, 1, 0)
            tl.debug_barrier()  # every thread's copy in the slot before any reads it
        else:
            base = src
            bias = src_bias
    return base, bias


@triton.constexpr_function
def _row_len(cols, fmt, qb, qbytes):
    """A row's length in its bank's elements: `row_ptrs`' stride."""
    return cols if fmt == 0 else cols // qb * qbytes


@triton.constexpr_function
def _units(n, word):
    return n // word if word else n


COPY_CHUNK = tl.constexpr(1024)  # words a copy moves per pass


@triton.jit
def _copy_rows(
    src, dst, r0, R: tl.constexpr, ROWS: tl.constexpr, ROW: tl.constexpr, WORD: tl.constexpr
):
    """Rows r0 .. r0 + R (those below ROWS) of a matrix of ROW elements a row, src to dst:
    one contiguous span, moved as WORD-byte words (0: as the matrix's own elements)."""
    start = r0.to(tl.int64) * ROW
    n = _units(ROW, WORD) * (tl.minimum(r0 + R, ROWS) - r0)
    s = _words(src + start, WORD)
    d = _words(dst + start, WORD)
    for c in range(0, _units(R * ROW, WORD), COPY_CHUNK):
        offs = c + tl.arange(0, COPY_CHUNK)
        m = offs < n
        tl.store(d + offs, tl.load(s + offs, mask=m), mask=m)


@triton.jit
def _words(p, WORD: tl.constexpr):
    """Byte pointers p as WORD-byte words' (0: p unchanged)."""
    if WORD == 4:
        return p.to(tl.pointer_type(tl.int32))
    elif WORD == 2:
        return p.to(tl.pointer_type(tl.int16))
    else:
        return p


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
