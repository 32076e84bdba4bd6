"""Drawing a token from every logit of a row, or from its k largest for a k too large to sort.

Near-uniform sampling (a high temperature, top_k in the thousands or none, top_p 1) kept
all its candidates, so torch sorted or ranked the whole vocabulary a token: 0.8 ms of an
H200 a row against a 1.3 ms decode step. Nothing here sorts; every kernel but the last
reads the row in blocks over many programs:

- `rank_kernel`, one launch a pass of a radix select: a histogram of the next digit of the
  keys that share the digits found so far, so that after three passes the key of the k-th
  largest logit is known exactly (every logit at or above it survives, ties included); its
  first pass also takes the row's largest key, which names the likeliest token.
- `mass_kernel`: each block's sum of exp((logit - top) / temperature) over the survivors
  (min_p rules out those under min_p times the likeliest's weight).
- `draw_kernel`, a program a row: the block where u times the total falls, then the token
  in it. The draw walks the survivors in token order: with top_p at 1 the order changes
  which token a given u names, not how likely each token is.

Keys are the logit's bits mapped so that unsigned order is float order (sample._key's high
half); the largest key travels with its token id as one 63-bit integer. A row's state is
ROW int64s, zeroed by the caller: its three histograms as int32s, then that largest key.
"""

import triton
import triton.language as tl

NB = 2048  # bins of a pass: digits of 10, 11 and 11 bits from the top
PASSES = 3


@triton.jit
def _ordered(x):
    bits = x.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) == 1, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def _value(ordered):
    bits = tl.where((ordered >> 31) == 1, ordered ^ 0x80000000, ordered ^ 0xFFFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _found(hist_ptr, k, DONE: tl.constexpr, NB: tl.constexpr):
    """The digits the first DONE passes found, as the key's top bits (key >> (22 - 11 *
    (DONE - 1))), and the rank the k-th largest has among the keys that share them."""
    d = tl.arange(0, NB)
    prefix = tl.full((), 0, tl.uint32)
    rank = tl.full((), 0, tl.int32) + k
    for p in tl.static_range(DONE):
        c = tl.load(hist_ptr + p * NB + d)
        at_or_above = tl.sum(c, axis=0) - tl.cumsum(c, axis=0) + c
        digit = tl.sum((at_or_above >= rank).to(tl.int32), axis=0) - 1
        rank -= tl.sum(tl.where(d > digit, c, 0), axis=0)
        prefix = (prefix << 11) | digit.to(tl.uint32)
    return prefix, rank


@triton.jit
def _threshold(hist_ptr, k, NEED_K: tl.constexpr, NB: tl.constexpr):
    """The key of the k-th largest logit (0, below every key, where every logit counts)."""
    if NEED_K:
        key, _ = _found(hist_ptr, k, 3, NB)
    else:
        key = tl.full((), 0, tl.uint32)
    return key


@triton.jit
def rank_kernel(
    logits_ptr,
    V,
    hist_ptr,
    top_ptr,
    k,
    PASS: tl.constexpr,
    NEED_K: tl.constexpr,
    BLOCK: tl.constexpr,
    NB: tl.constexpr,
    ROW: tl.constexpr,
):
    """Pass PASS over block program_id(0) of row program_id(1): hist[row, PASS] counts the
    next digit of the keys that share the digits found before; pass 0 also raises top[row]
    to the block's largest (key << 31 | token)."""
    pid, row = tl.program_id(0), tl.program_id(1)
    ids = pid * BLOCK + tl.arange(0, BLOCK)
    valid = ids < V
    key = _ordered(tl.load(logits_ptr + row * V + ids, mask=valid, other=float("-inf")))
    hist_ptr += row * 2 * ROW
    if PASS == 0:
        both = (key.to(tl.int64) << 31) | ids.to(tl.int64)
        tl.atomic_max(top_ptr + row * ROW + ROW - 1, tl.max(tl.where(valid, both, 0), axis=0))
    if NEED_K:
        shift = 22 - 11 * PASS
        if PASS == 0:
            match = valid
        else:
            prefix, _ = _found(hist_ptr, k, PASS, NB)
            match = valid & ((key >> (shift + 11)) == prefix)
        digit = ((key >> shift) & (NB - 1)).to(tl.int32)
        counts = tl.histogram(digit, NB, mask=match)
        bins = tl.arange(0, NB)
        tl.atomic_add(hist_ptr + PASS * NB + bins, counts, mask=counts > 0)


@triton.jit
def _weights(logits_ptr, V, row, ids, hist_ptr, top_ptr, k, inv_temp, log_min_p, NEED_K, NB, ROW):
    """Each token's weight exp((logit - top) / temperature) where it survives top-k and
    min_p, else 0; and the likeliest token's logit and id."""
    valid = ids < V
    x = tl.load(logits_ptr + row * V + ids, mask=valid, other=float("-inf"))
    both = tl.load(top_ptr + row * ROW + ROW - 1)
    top = _value((both >> 31).to(tl.uint32))
    threshold = _threshold(hist_ptr + row * 2 * ROW, k, NEED_K, NB)
    z = (x - top) * inv_temp
    keep = valid & (_ordered(x) >= threshold) & (z >= log_min_p)
    return tl.where(keep, tl.exp(z), 0.0), top, (both & 0x7FFFFFFF).to(tl.int32)


@triton.jit
def mass_kernel(
    logits_ptr,
    V,
    hist_ptr,
    top_ptr,
    sums_ptr,
    k,
    inv_temp,
    log_min_p,
    NEED_K: tl.constexpr,
    BLOCK: tl.constexpr,
    NB: tl.constexpr,
    ROW: tl.constexpr,
):
    """sums[row, pid] = the survivors' weight in block pid of row program_id(1)."""
    pid, row = tl.program_id(0), tl.program_id(1)
    ids = pid * BLOCK + tl.arange(0, BLOCK)
    w, _, _ = _weights(
        logits_ptr, V, row, ids, hist_ptr, top_ptr, k, inv_temp, log_min_p, NEED_K, NB, ROW
    )
    tl.store(sums_ptr + row * tl.num_programs(0) + pid, tl.sum(w, axis=0))


@triton.jit
def draw_kernel(
    logits_ptr,
    V,
    hist_ptr,
    top_ptr,
    sums_ptr,
    blocks,
    u_ptr,
    out_ptr,
    k,
    inv_temp,
    log_min_p,
    NEED_K: tl.constexpr,
    BLOCK: tl.constexpr,
    NBLK: tl.constexpr,
    NB: tl.constexpr,
    ROW: tl.constexpr,
):
    """out[row] = the survivor where u[row] times the row's total weight falls, counting in
    token order; a logit that is infinite or NaN at the top takes the draw."""
    row = tl.program_id(0)
    b = tl.arange(0, NBLK)
    s = tl.load(sums_ptr + row * blocks + b, mask=b < blocks, other=0.0)
    target = tl.load(u_ptr + row) * tl.sum(s, axis=0)
    # the block: the first whose running total passes the target (rounding may leave the
    # total just under it: then the last block with weight)
    last = tl.max(tl.where(s > 0, b, 0), axis=0)
    blk = tl.minimum(tl.sum((tl.cumsum(s, axis=0) <= target).to(tl.int32), axis=0), last)
    target -= tl.sum(tl.where(b < blk, s, 0.0), axis=0)
    r = tl.arange(0, BLOCK)
    ids = blk * BLOCK + r
    w, top, top_id = _weights(
        logits_ptr, V, row, ids, hist_ptr, top_ptr, k, inv_temp, log_min_p, NEED_K, NB, ROW
    )
    end = tl.max(tl.where(w > 0, r, 0), axis=0)
    j = tl.minimum(tl.sum((tl.cumsum(w, axis=0) <= target).to(tl.int32), axis=0), end)
    finite = (top == top) & (tl.abs(top) < float("inf"))
    tl.store(out_ptr + row, tl.where(finite, blk * BLOCK + j, top_id).to(tl.int64))
