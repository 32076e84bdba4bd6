"""Decode attention of multi-head latent attention in its absorbed form, straight from the
paged latent pool (layers/mla.py).

Every head attends over the same per-token latent [c (R), k_pe (P)]: the query of a head is
q_abs [R] (its rope-free query absorbed into W_UK) and q_pe [P], the score
q_abs·c + q_pe·k_pe, and the output the softmax-weighted sum of c [R], which the layer then
takes through W_UV. A program serves a block of heads of one sequence, so each latent is
read once for the block, through the block table in place. Long contexts are cut into
splits, each a program, merged by a second kernel through each split's log-sum-exp.
"""

import triton
import triton.language as tl


@triton.jit
def mla_decode_kernel(
    q_ptr,
    pe_ptr,
    pool_ptr,
    table_ptr,
    lens_ptr,
    out_ptr,
    part_ptr,
    lse_ptr,
    scale,
    table_stride,
    H,
    SPLITS,
    R: tl.constexpr,
    R_BLOCK: tl.constexpr,
    P: tl.constexpr,
    P_BLOCK: tl.constexpr,
    HB: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,
):
    """q_abs [B, H, R], q_pe [B, H, P]; pool [slots, 1, R + P]; table [B, pages]; lens [B].
    DIRECT: write the output [B, H, R]; else this split's normalised output
    [B, H, SPLITS, R] and its log-sum-exp [B, H, SPLITS]."""
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    n_ctx = tl.load(lens_ptr + b)
    per = tl.cdiv(tl.cdiv(n_ctx, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per
    hi = tl.minimum(lo + per, n_ctx)
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    hmask = h < H
    heads = b * H + h
    r = tl.arange(0, R_BLOCK)
    p = tl.arange(0, P_BLOCK)
    qmask = hmask[:, None] & (r < R)[None, :]
    q = tl.load(q_ptr + heads[:, None] * R + r[None, :], mask=qmask, other=0.0)
    pmask = hmask[:, None] & (p < P)[None, :]
    qp = tl.load(pe_ptr + heads[:, None] * P + p[None, :], mask=pmask, other=0.0)
    row0 = table_ptr + b * table_stride
    m_i, l_i, acc = _attend(q, qp, pool_ptr, row0, lo, hi, scale, R, P, PAGE, BLOCK_N)
    _store(out_ptr, part_ptr, lse_ptr, acc, m_i, l_i, heads, hmask, split, SPLITS, R, DIRECT)


@triton.jit
def _attend(q, qp, pool_ptr, row0, lo, hi, scale, R, P, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Positions [lo, hi) through the block table row row0, by online softmax: the running
    max, denominator and (unnormalised) output of the block of heads q [HB, R_BLOCK]."""
    r = tl.arange(0, q.shape[1])
    p = tl.arange(0, qp.shape[1])
    m_i = tl.full((q.shape[0],), float("-inf"), tl.float32)
    l_i = tl.zeros((q.shape[0],), tl.float32)
    acc = tl.zeros((q.shape[0], q.shape[1]), tl.float32)
    start = lo
    while start < hi:  # a loop with data-dependent bounds that Triton's interpreter also runs
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < hi
        page = tl.load(row0 + n // PAGE, mask=nmask, other=0)
        rows = (page * PAGE + n % PAGE) * (R + P)
        cmask = nmask[:, None] & (r < R)[None, :]
        c = tl.load(pool_ptr + rows[:, None] + r[None, :], mask=cmask, other=0.0)
        kmask = nmask[:, None] & (p < P)[None, :]
        kp = tl.load(pool_ptr + rows[:, None] + R + p[None, :], mask=kmask, other=0.0)
        s = tl.dot(q, tl.trans(c), input_precision="ieee")
        s = (s + tl.dot(qp, tl.trans(kp), input_precision="ieee")) * scale
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        w = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(w, axis=1)
        acc = acc * alpha[:, None] + tl.dot(w.to(c.dtype), c, input_precision="ieee")
        m_i = m_new
        start += BLOCK_N
    return m_i, l_i, acc


@triton.jit
def _store(out_ptr, part_ptr, lse_ptr, acc, m_i, l_i, heads, hmask, split, SPLITS, R, DIRECT):
    """The output of one split: final where there is one split, else with its log-sum-exp."""
    r = tl.arange(0, acc.shape[1])
    mask = hmask[:, None] & (r < R)[None, :]
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a split past the length has nothing
    if DIRECT:
        at = heads[:, None] * R + r[None, :]
        tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        at = heads * SPLITS + split
        tl.store(part_ptr + at[:, None] * R + r[None, :], out, mask=mask)
        lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + at, lse, mask=hmask)


@triton.jit
def mla_merge_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    SPLITS,
    R: tl.constexpr,
    R_BLOCK: tl.constexpr,
    S_BLOCK: tl.constexpr,
):
    """One (sequence, head) a program: the splits' outputs [SPLITS, R] weighted by their
    share of the softmax's denominator."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, S_BLOCK)
    r = tl.arange(0, R_BLOCK)
    smask = s < SPLITS
    rmask = r < R
    lse = tl.load(lse_ptr + row * SPLITS + s, mask=smask, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, axis=0))
    w = w / tl.sum(w, axis=0)
    parts = tl.load(
        part_ptr + (row * SPLITS + s)[:, None] * R + r[None, :],
        mask=smask[:, None] & rmask[None, :],
        other=0.0,
    )
    merged = tl.sum(parts * w[:, None], axis=0)
    tl.store(out_ptr + row * R + r, merged.to(out_ptr.dtype.element_ty), mask=rmask)
