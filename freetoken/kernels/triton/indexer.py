"""The lightning indexer's scores straight from the paged pool (layers/indexer.py).

For query token t and the keys in pool rows lists[which[t], s] (s < seen[t]; -1: none),

    I[t, s] = Σ_h w[t, h] · relu(q[t, h] · k_s) · scale,   -inf where the key is not seen.

A program serves one token and a block of keys: the keys are read once, in place, for all
of the token's heads (a [heads, d] x [d, keys] product), and the heads summed there, so
neither the gathered keys nor the per-head scores ever reach memory.
"""

import triton
import triton.language as tl


@triton.jit
def index_scores_kernel(
    q_ptr,
    w_ptr,
    pool_ptr,
    lists_ptr,
    which_ptr,
    seen_ptr,
    out_ptr,
    scale,
    pool_stride,
    list_stride,
    S,
    HEADS: tl.constexpr,
    H_BLOCK: tl.constexpr,
    D: tl.constexpr,
    D_BLOCK: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """q [T, HEADS, D], w [T, HEADS] (fp32), pool [N, 1, >= D] rows pool_stride apart,
    lists [L, S] (int32), which/seen [T] (int32) -> out [T, S] (fp32)."""
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    lst = tl.load(which_ptr + t).to(tl.int64)
    ok = (s < S) & (s < tl.load(seen_ptr + t))
    r = tl.load(lists_ptr + lst * list_stride + s, mask=ok, other=-1)
    ok = ok & (r >= 0)
    h = tl.arange(0, H_BLOCK)
    d = tl.arange(0, D_BLOCK)
    q = tl.load(
        q_ptr + (t * HEADS + h)[:, None] * D + d[None, :],
        mask=(h < HEADS)[:, None] & (d < D)[None, :],
        other=0.0,
    )
    at = tl.where(ok, r, 0).to(tl.int64) * pool_stride
    k = tl.load(pool_ptr + at[:, None] + d[None, :], mask=ok[:, None] & (d < D)[None, :], other=0.0)
    dots = tl.dot(q, tl.trans(k), input_precision="ieee")  # [H_BLOCK, BLOCK_S]
    w = tl.load(w_ptr + t * HEADS + h, mask=h < HEADS, other=0.0)
    score = tl.sum(tl.maximum(dots, 0.0) * scale * w[:, None], axis=0)
    tl.store(out_ptr + t * S + s, tl.where(ok, score, float("-inf")), mask=s < S)
