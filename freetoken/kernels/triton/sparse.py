"""Sparse MQA attention over chosen rows of the paged pool (layers/sparse.py), for decode
steps and prefill chunks alike.

Each query token t has a list of K rows (-1: none); every one of its H heads attends over
them with one query: the score is q·row[:D], the value row[:DV] (DV <= D: an MLA latent
absorbed is [c, k_pe] with the value c; a compressed layer's row is key and value whole),
and a learned sink per head may join the softmax's denominator. A program serves a block of
heads of one token, so each row is read once for the block; long lists are cut into splits,
each a program, merged by a second kernel through each split's log-sum-exp (the sink joins
there, once).
"""

import triton
import triton.language as tl


@triton.jit
def sparse_attention_kernel(
    q_ptr,
    pool_ptr,
    rows_ptr,
    sink_ptr,
    out_ptr,
    part_ptr,
    lse_ptr,
    scale,
    pool_stride,
    H,
    K,
    SPLITS,
    D: tl.constexpr,
    DV: tl.constexpr,
    DV_BLOCK: tl.constexpr,
    DR_BLOCK: tl.constexpr,
    HB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SINK: tl.constexpr,
    DIRECT: tl.constexpr,
):
    """q [T, H, D]; pool [N, 1, >= D] rows pool_stride apart; rows [T, K] (int32); sink [H].
    DIRECT: write the output [T, H, DV]; else this split's normalised output
    [T, H, SPLITS, DV] and its log-sum-exp [T, H, SPLITS]."""
    t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    per = tl.cdiv(tl.cdiv(K, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per
    hi = tl.minimum(lo + per, K)
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    hmask = h < H
    heads = t * H + h
    v = tl.arange(0, DV_BLOCK)
    q = tl.load(
        q_ptr + heads[:, None] * D + v[None, :],
        mask=hmask[:, None] & (v < DV)[None, :],
        other=0.0,
    )
    e = DV + tl.arange(0, DR_BLOCK)  # the key's part beyond the value, if any
    qe = tl.load(
        q_ptr + heads[:, None] * D + e[None, :], mask=hmask[:, None] & (e < D)[None, :], other=0.0
    )
    row0 = rows_ptr + t * K
    m_i, l_i, acc = _attend(q, qe, pool_ptr, row0, lo, hi, scale, pool_stride, D, DV, BLOCK_N)
    if DIRECT and HAS_SINK:
        sink = tl.load(sink_ptr + h, mask=hmask, other=0.0)
        m_f = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m_f)
        l_i = l_i * alpha + tl.exp(sink - m_f)
        acc = acc * alpha[:, None]
    _store(out_ptr, part_ptr, lse_ptr, acc, m_i, l_i, heads, hmask, split, SPLITS, DV, DIRECT)


@triton.jit
def _attend(
    q,
    qe,
    pool_ptr,
    row0,
    lo,
    hi,
    scale,
    stride,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Rows [lo, hi) of the list at row0, by online softmax: the running max, denominator
    and (unnormalised) output of the block of heads q [HB, DV_BLOCK]."""
    v = tl.arange(0, q.shape[1])
    e = DV + tl.arange(0, qe.shape[1])
    m_i = tl.full((q.shape[0],), float("-inf"), tl.float32)
    l_i = tl.zeros((q.shape[0],), tl.float32)
    acc = tl.zeros((q.shape[0], q.shape[1]), tl.float32)
    start = lo
    while start < hi:  # a loop with data-dependent bounds that Triton's interpreter also runs
        n = start + tl.arange(0, BLOCK_N)
        r = tl.load(row0 + n, mask=n < hi, other=-1)
        ok = r >= 0
        at = tl.where(ok, r, 0).to(tl.int64) * stride
        c = tl.load(
            pool_ptr + at[:, None] + v[None, :], mask=ok[:, None] & (v < DV)[None, :], other=0.0
        )
        s = tl.dot(q, tl.trans(c), input_precision="ieee")
        if D > DV:  # the key's part beyond the value (an absorbed latent's k_pe)
            ke = tl.load(
                pool_ptr + at[:, None] + e[None, :], mask=ok[:, None] & (e < D)[None, :], other=0.0
            )
            s += tl.dot(qe, tl.trans(ke), input_precision="ieee")
        s = s * scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no row yet: nothing to scale
        alpha = tl.exp(m_i - m_safe)
        w = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(w, axis=1)
        acc = acc * alpha[:, None] + tl.dot(w.to(c.dtype), c, input_precision="ieee")
        m_i = m_new
        start += BLOCK_N
    return m_i, l_i, acc


@triton.jit
def _store(out_ptr, part_ptr, lse_ptr, acc, m_i, l_i, heads, hmask, split, SPLITS, DV, DIRECT):
    """The output of one split: final where there is one split, else with its log-sum-exp."""
    v = tl.arange(0, acc.shape[1])
    mask = hmask[:, None] & (v < DV)[None, :]
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # nothing to attend to: zero
    if DIRECT:
        at = heads[:, None] * DV + v[None, :]
        tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        at = heads * SPLITS + split
        tl.store(part_ptr + at[:, None] * DV + v[None, :], out, mask=mask)
        lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + at, lse, mask=hmask)


@triton.jit
def sparse_merge_kernel(
    part_ptr,
    lse_ptr,
    sink_ptr,
    out_ptr,
    H,
    SPLITS,
    DV: tl.constexpr,
    DV_BLOCK: tl.constexpr,
    S_BLOCK: tl.constexpr,
    HAS_SINK: tl.constexpr,
):
    """One (token, head) a program: the splits' outputs [SPLITS, DV] weighted by their share
    of the softmax's denominator, the head's sink counted once in it."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, S_BLOCK)
    v = tl.arange(0, DV_BLOCK)
    smask = s < SPLITS
    lse = tl.load(lse_ptr + row * SPLITS + s, mask=smask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    if HAS_SINK:
        sink = tl.load(sink_ptr + row % H)
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)
    total = tl.sum(w, axis=0)
    if HAS_SINK:
        total += tl.exp(sink - m)
    w = w / tl.where(total > 0, total, 1.0)
    parts = tl.load(
        part_ptr + (row * SPLITS + s)[:, None] * DV + v[None, :],
        mask=smask[:, None] & (v < DV)[None, :],
        other=0.0,
    )
    merged = tl.sum(parts * w[:, None], axis=0)
    tl.store(out_ptr + row * DV + v, merged.to(out_ptr.dtype.element_ty), mask=v < DV)
