"""Decode attention straight from the paged KV pool, and the KV write of a step.

At one token a step the torch code gathers every sequence's padded context out of the pool
(two copies), then runs SDPA over the whole padding, masked; these read the pages in place
through the block table and stop at each sequence's length. One program serves a KV head
and the query heads that share it (grouped-query attention), so K and V are read once for
the group. Long contexts are cut into splits, each a program, merged by a second kernel
through each split's log-sum-exp.

Options compiled in only where a layer has them (constexpr; off, the kernel is the plain
one): WINDOW > 0 reads each sequence's last WINDOW positions alone; `sinks_ptr` (None: no
sinks) adds a logit per query head to the softmax's denominator, once: in the direct path
as the running maximum and sum's start, with splits as one more term of the merge (a row
whose log-sum-exp is the sink and whose output is zero, so the merge kernel is unchanged).
"""

import triton
import triton.language as tl


@triton.jit
def decode_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    lens_ptr,
    out_ptr,
    part_ptr,
    lse_ptr,
    sinks_ptr,
    scale,
    table_stride,
    H,
    KVH,
    SPLITS,
    GROUP: tl.constexpr,
    G_BLOCK: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """q [B, H, D]; k/v pools [slots, KVH, D]; table [B, pages]; lens [B]; sinks [H] or None.
    DIRECT: write the output [B, H, D]; else this split's normalised output [B, H, R, D] and
    its log-sum-exp [B, H, R], R = SPLITS (+ 1 for the sinks' row)."""
    b = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1)
    split = tl.program_id(2)
    n_ctx = tl.load(lens_ptr + b)
    if WINDOW > 0:
        first = tl.maximum(n_ctx - WINDOW, 0)
        per = tl.cdiv(tl.cdiv(n_ctx - first, SPLITS), BLOCK_N) * BLOCK_N
        lo = first + split * per
    else:
        per = tl.cdiv(tl.cdiv(n_ctx, SPLITS), BLOCK_N) * BLOCK_N
        lo = split * per
    hi = tl.minimum(lo + per, n_ctx)
    g = tl.arange(0, G_BLOCK)
    d = tl.arange(0, D)
    heads = b * H + kh * GROUP + g
    gmask = g < GROUP
    q = tl.load(q_ptr + heads[:, None] * D + d[None, :], mask=gmask[:, None], other=0.0)
    m_i = tl.full((G_BLOCK,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_BLOCK,), tl.float32)
    acc = tl.zeros((G_BLOCK, D), tl.float32)
    merged = SPLITS  # rows per head of the split outputs
    if sinks_ptr is not None:
        sink = tl.load(sinks_ptr + kh * GROUP + g, mask=gmask, other=0.0).to(tl.float32)
        if DIRECT:  # the sink as a first key of weight exp(sink) and value zero
            m_i = sink
            l_i = tl.full((G_BLOCK,), 1.0, tl.float32)
        else:  # the merge's extra row, written once per head
            merged = SPLITS + 1
            if split == 0:
                at = heads * merged + SPLITS
                tl.store(lse_ptr + at, sink, mask=gmask)
                zeros = tl.zeros((G_BLOCK, D), tl.float32)
                tl.store(part_ptr + at[:, None] * D + d[None, :], zeros, mask=gmask[:, None])
    start = lo
    while start < hi:  # a loop with data-dependent bounds that Triton's interpreter also runs
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < hi
        page = tl.load(table_ptr + b * table_stride + n // PAGE, mask=nmask, other=0)
        rows = (page * PAGE + n % PAGE) * KVH + kh
        k = tl.load(k_ptr + rows[:, None] * D + d[None, :], mask=nmask[:, None], other=0.0)
        v = tl.load(v_ptr + rows[:, None] * D + d[None, :], mask=nmask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
        start += BLOCK_N
    _store_split(out_ptr, part_ptr, lse_ptr, acc, m_i, l_i, heads, gmask, split, merged, D, DIRECT)


@triton.jit
def _store_split(
    out_ptr,
    part_ptr,
    lse_ptr,
    acc,
    m_i,
    l_i,
    heads,
    gmask,
    split,
    ROWS,
    D: tl.constexpr,
    DIRECT: tl.constexpr,
):
    """The output of one split: final where there is one split, else with its log-sum-exp
    (ROWS of them per head)."""
    d = tl.arange(0, D)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a split past the length has nothing
    if DIRECT:
        tl.store(
            out_ptr + heads[:, None] * D + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=gmask[:, None],
        )
    else:
        at = heads * ROWS + split
        tl.store(part_ptr + at[:, None] * D + d[None, :], out, mask=gmask[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + at, lse, mask=gmask)


@triton.jit
def merge_splits_kernel(part_ptr, lse_ptr, out_ptr, SPLITS, D: tl.constexpr, S_BLOCK: tl.constexpr):
    """One (sequence, head) a program: the splits' outputs weighted by their share of the
    softmax's denominator."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, S_BLOCK)
    d = tl.arange(0, D)
    smask = s < SPLITS
    lse = tl.load(lse_ptr + row * SPLITS + s, mask=smask, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, axis=0))
    w = w / tl.sum(w, axis=0)
    parts = tl.load(
        part_ptr + (row * SPLITS + s)[:, None] * D + d[None, :], mask=smask[:, None], other=0.0
    )
    tl.store(out_ptr + row * D + d, tl.sum(parts * w[:, None], axis=0).to(out_ptr.dtype.element_ty))


@triton.jit
def store_kv_kernel(
    k_ptr, v_ptr, slots_ptr, k_pool_ptr, v_pool_ptr, W: tl.constexpr, BLOCK: tl.constexpr
):
    """Token t's k and v ([T, W] each, W = KV heads × head dim) into pool slot slots[t]."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    offs = tl.arange(0, BLOCK)
    m = offs < W
    dt = k_pool_ptr.dtype.element_ty
    tl.store(k_pool_ptr + slot * W + offs, tl.load(k_ptr + t * W + offs, mask=m).to(dt), mask=m)
    tl.store(v_pool_ptr + slot * W + offs, tl.load(v_ptr + t * W + offs, mask=m).to(dt), mask=m)
