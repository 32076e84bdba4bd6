"""Routed experts for small batches, reading experts from the GPU slot pool.

One program per (route, row tile). Routes whose slot is negative are served elsewhere
(the CPU) and are skipped: the down kernel writes their rows of `out` as zeros, so `out`
needs no clearing launch first. Shapes: x [T, H], slots/weights [T*k], gate_up [S, 2I, H],
down [S, H, I], the optional biases gate_up_bias [S, 2I] and down_bias [S, H], h [T*k, I]
(fp32), out [T*k, H] (fp32, weighted per route). ACT 0 is SwiGLU, 1 gpt-oss's clamped
form, 2 SwiGLU of clamped inputs (models/base.py, ACTIVATIONS).

With HOST, a negative slot is a miss split by its rows: the kernels read the expert's first
rows (of gate and up, and the same columns of down) straight from the pinned host banks,
and the CPU lane computes the rest at the same time (moe/lane.py). Over PCIe a read is as
slow as a fetch, so it is worth its share only because the CPU's part shrinks with it.

With FILL, a route whose slot the books filled this step (`fill_ptr`: the slot each route
first to its expert fills, -1 for none) reads its expert from the host banks too, and the
route first to it writes what it read into the slot: a miss's fetch and its compute are
one pass over PCIe, and the layer's cached routes compute meanwhile, where a fetch kernel
ahead of the expert kernels had them wait for it. Every route to that expert reads the
host, so none reads the slot while it is written.

H and I are compile-time constants: a model has one expert shape, and loops over constant
bounds are the ones Triton's interpreter runs as well (it cannot turn a run-time integer
argument into a Python loop bound).
"""

import triton
import triton.language as tl


@triton.jit
def _activate(g, u, alpha, limit, ACT: tl.constexpr):
    if ACT == 0:
        return g * tl.sigmoid(g) * u
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    if ACT == 2:
        return g * tl.sigmoid(g) * u
    return (u + 1.0) * g * tl.sigmoid(alpha * g)


@triton.jit
def gate_up_kernel(
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
    rows_ptr,
    fill_ptr,
    H: tl.constexpr,
    I: tl.constexpr,
    K: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    HOST: tl.constexpr,
    FILL: tl.constexpr,
    ROUTES: tl.constexpr,
):
    """HOST: a route with a negative slot is read from the host banks (`host_ptr`, by its
    expert in `ids_ptr`) for its first `rows_ptr[0]` intermediate rows (the CPU computes
    the rest); without HOST it is skipped. FILL: a route whose slot is filled this step
    reads the host banks, the first route to it writing them into the slot. ROUTES: a
    power of two at least the routes (the grid's first dimension)."""
    r = tl.program_id(0)
    slot = tl.load(slot_ptr + r)
    i0 = tl.program_id(1) * BLOCK_I
    rows = tl.full([], I, tl.int32)
    base = gu_ptr + slot.to(tl.int64) * (2 * I * H)
    bias = bias_ptr + slot.to(tl.int64) * (2 * I)
    dst, dst_bias = base, bias
    write = tl.full([], 0, tl.int1)
    if slot < 0:
        if not HOST:
            return
        e = tl.load(ids_ptr + r).to(tl.int64)
        rows = tl.load(rows_ptr).to(tl.int32)
        base = host_ptr + e * (2 * I * H)
        bias = host_bias_ptr + e * (2 * I)
    elif FILL:
        if _filled_now(fill_ptr, slot, tl.num_programs(0), ROUTES):
            e = tl.load(ids_ptr + r).to(tl.int64)
            base = host_ptr + e * (2 * I * H)
            bias = host_bias_ptr + e * (2 * I)
            write = tl.load(fill_ptr + r) >= 0
    if i0 < rows:  # a host route's later blocks read nothing
        _gate_up_rows(
            *(x_ptr, base, bias, h_ptr, r, r // K, i0, rows, alpha, limit),
            *(dst, dst_bias, write),
            *(H, I, BLOCK_I, BLOCK_H, HAS_BIAS, ACT, FILL),
        )


@triton.jit
def _filled_now(fill_ptr, slot, routes, ROUTES: tl.constexpr):
    """Whether the books fill `slot` this step: some route's entry of `fill_ptr` names it."""
    offs = tl.arange(0, ROUTES)
    filled = tl.load(fill_ptr + offs, mask=offs < routes, other=-1)
    return tl.max((filled == slot).to(tl.int32), axis=0) > 0


@triton.jit
def _gate_up_rows(
    x_ptr,
    base,
    bias,
    h_ptr,
    r,
    t,
    i0,
    rows,
    alpha,
    limit,
    dst,
    dst_bias,
    write,
    H: tl.constexpr,
    I: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    FILL: tl.constexpr,
):
    """h[r, i] for the block of rows from i0, those below `rows`, of one expert at `base`;
    with FILL and `write`, the rows read are written at `dst` (and the biases at
    `dst_bias`), the same places of a slot."""
    offs_i = i0 + tl.arange(0, BLOCK_I)
    mask_i = offs_i < rows
    acc_g = tl.zeros([BLOCK_I], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        xv = tl.load(x_ptr + t * H + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        m = mask_i[:, None] & mask_h[None, :]
        at_g = offs_i[:, None] * H + offs_h[None, :]
        wg = tl.load(base + at_g, mask=m, other=0.0)
        wu = tl.load(base + I * H + at_g, mask=m, other=0.0)
        if FILL:
            tl.store(dst + at_g, wg, mask=m & write)
            tl.store(dst + I * H + at_g, wu, mask=m & write)
        acc_g += tl.sum(wg.to(tl.float32) * xv[None, :], axis=1)
        acc_u += tl.sum(wu.to(tl.float32) * xv[None, :], axis=1)
    if HAS_BIAS:
        bg = tl.load(bias + offs_i, mask=mask_i, other=0.0)
        bu = tl.load(bias + I + offs_i, mask=mask_i, other=0.0)
        if FILL:
            tl.store(dst_bias + offs_i, bg, mask=mask_i & write)
            tl.store(dst_bias + I + offs_i, bu, mask=mask_i & write)
        acc_g += bg.to(tl.float32)
        acc_u += bu.to(tl.float32)
    h = _activate(acc_g, acc_u, alpha, limit, ACT)
    tl.store(h_ptr + r * I + offs_i, h, mask=mask_i)


@triton.jit
def down_kernel(
    h_ptr,
    dn_ptr,
    bias_ptr,
    slot_ptr,
    w_ptr,
    out_ptr,
    host_ptr,
    host_bias_ptr,
    ids_ptr,
    rows_ptr,
    fill_ptr,
    H: tl.constexpr,
    I: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_I: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HOST: tl.constexpr,
    FILL: tl.constexpr,
    ROUTES: tl.constexpr,
):
    """HOST as gate_up_kernel's: a host route's first rows, without the down bias (the
    CPU's part adds it). FILL as gate_up_kernel's, the down bias filled too."""
    r = tl.program_id(0)
    slot = tl.load(slot_ptr + r)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    wr = tl.load(w_ptr + r).to(tl.float32)
    if slot < 0:
        if HOST:
            e = tl.load(ids_ptr + r).to(tl.int64)
            acc = _down_rows(
                *(h_ptr, host_ptr + e * (H * I), r, offs_h, mask_h, tl.load(rows_ptr)),
                *(host_ptr, tl.full([], 0, tl.int1), I, BLOCK_H, BLOCK_I, False),
            )
            tl.store(out_ptr + r * H + offs_h, acc * wr, mask=mask_h)
        else:  # served elsewhere: its rows of out are zeros (out is not cleared first)
            tl.store(out_ptr + r * H + offs_h, tl.zeros([BLOCK_H], tl.float32), mask=mask_h)
        return
    s = slot.to(tl.int64)
    base, bias = dn_ptr + s * (H * I), bias_ptr + s * H
    dst, dst_bias = base, bias
    write = tl.full([], 0, tl.int1)
    if FILL:
        if _filled_now(fill_ptr, slot, tl.num_programs(0), ROUTES):
            e = tl.load(ids_ptr + r).to(tl.int64)
            base, bias = host_ptr + e * (H * I), host_bias_ptr + e * H
            write = tl.load(fill_ptr + r) >= 0
    acc = _down_rows(*(h_ptr, base, r, offs_h, mask_h, I, dst, write), *(I, BLOCK_H, BLOCK_I, FILL))
    if HAS_BIAS:
        b = tl.load(bias + offs_h, mask=mask_h, other=0.0)
        if FILL:
            tl.store(dst_bias + offs_h, b, mask=mask_h & write)
        acc += b.to(tl.float32)
    tl.store(out_ptr + r * H + offs_h, acc * wr, mask=mask_h)


@triton.jit
def _down_rows(
    h_ptr,
    base,
    r,
    offs_h,
    mask_h,
    rows,
    dst,
    write,
    I: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_I: tl.constexpr,
    FILL: tl.constexpr,
):
    """down[offs_h, :rows] . h[r, :rows] of one expert at `base` (columns from `rows` on
    are not read: over PCIe, each is time); with FILL and `write`, what it reads is written
    at `dst`, the same places of a slot."""
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for i0 in range(0, I, BLOCK_I):
        offs_i = i0 + tl.arange(0, BLOCK_I)
        mask_i = offs_i < rows
        hv = tl.load(h_ptr + r * I + offs_i, mask=mask_i, other=0.0)
        m = mask_h[:, None] & mask_i[None, :]
        at = offs_h[:, None] * I + offs_i[None, :]
        wd = tl.load(base + at, mask=m, other=0.0)
        if FILL:
            tl.store(dst + at, wd, mask=m & write)
        acc += tl.sum(wd.to(tl.float32) * hv[None, :], axis=1)
    return acc


@triton.jit
def combine_kernel(out_ptr, y_ptr, H: tl.constexpr, K: tl.constexpr, BLOCK_H: tl.constexpr):
    """y [T, H] in y's dtype = each token's K weighted route rows of out [T*K, H] (fp32)
    summed in route order: one launch where a sum and a cast were two."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in range(K):
        acc += tl.load(out_ptr + (t * K + j) * H + offs, mask=mask, other=0.0)
    tl.store(y_ptr + t * H + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)
