"""Top-k sampling of a token from each row of logits in two kernels.

Each program of `block_top_kernel` keeps the KP largest logits of a block of the vocabulary;
`pick_kernel` keeps the KP largest of those candidates, then the k largest, and draws a token from
them with temperature, top-p and min-p by inverse CDF at a given uniform `u`. A logit and
its token id travel together as one 64-bit key: the logit's bits mapped so that unsigned
order is float order, above the id, so one sort orders both.
"""

import triton
import triton.language as tl


@triton.jit
def _key(x, ids):
    bits = x.to(tl.uint32, bitcast=True)
    # negative floats: every bit flipped (larger magnitude sorts lower); the rest: the sign
    # bit set, so that they sort above every negative one
    ordered = tl.where((bits >> 31) == 1, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    return (ordered.to(tl.uint64) << 32) | ids.to(tl.uint64)


@triton.jit
def _logit(key):
    hi = (key >> 32).to(tl.uint32)
    bits = tl.where((hi >> 31) == 1, hi ^ 0x80000000, hi ^ 0xFFFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def block_top_kernel(logits_ptr, V, keys_ptr, KP: tl.constexpr, BLOCK: tl.constexpr):
    """For row b = program_id(1) of logits [B, V]: keys[b, pid * KP + j] = the j-th largest
    key of its logits[pid * BLOCK:][:BLOCK], j < KP."""
    pid, row = tl.program_id(0), tl.program_id(1)
    ids = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row * V + ids, mask=ids < V, other=float("-inf")).to(tl.float32)
    # a bitonic top-KP: the sort's first log2(KP) stages, then halving merges (a fraction of
    # the full sort's work for KP = 64 of 4096)
    keys = tl.topk(_key(x, ids), KP)
    r = tl.arange(0, KP)
    out = keys_ptr + (row * tl.num_programs(0) + pid) * KP + r
    tl.store(out, keys.to(tl.int64, bitcast=True))


@triton.jit
def pick_kernel(
    keys_ptr, n, u_ptr, out_ptr, k, inv_temp, top_p, min_p, NC: tl.constexpr, KP: tl.constexpr
):
    """out[b] = the token drawn at u[b] from the k largest of row b's n candidate keys
    (b = program_id(0)): softmax at 1/inv_temp over them, the smallest prefix whose mass
    before it stays under top_p (pass a value above 1 for none), tokens at least min_p times
    the likeliest one; k <= KP <= n."""
    row = tl.program_id(0)
    keys_ptr += row * n
    u_ptr += row
    out_ptr += row
    c = tl.arange(0, NC)
    keys = tl.load(keys_ptr + c, mask=c < n, other=0).to(tl.uint64, bitcast=True)
    keys = tl.topk(keys, KP)  # the KP largest, in order: the rest is arithmetic on them
    r = tl.arange(0, KP)
    ids = keys.to(tl.uint32).to(tl.int32)
    v = _logit(keys)
    top = tl.max(tl.where(r == 0, v, float("-inf")), axis=0)
    e = tl.where(r < k, tl.exp((v - top) * inv_temp), 0.0)
    p = e / tl.sum(e, axis=0)
    keep = (r < k) & ((tl.cumsum(p, axis=0) - p < top_p) | (r == 0))
    keep = keep & ((p >= min_p * tl.max(p, axis=0)) | (r == 0))
    q = tl.where(keep, p, 0.0)
    target = tl.load(u_ptr) * tl.sum(q, axis=0)
    below = tl.sum(((tl.cumsum(q, axis=0) <= target) & keep).to(tl.int32), axis=0)
    # the last token with mass: rounding may leave the cumulative sum just under the target
    last = tl.sum((q > 0).to(tl.int32), axis=0) - 1
    choice = tl.maximum(tl.minimum(below, last), 0)
    tl.store(out_ptr, tl.sum(tl.where(r == choice, ids, 0), axis=0).to(tl.int64))
