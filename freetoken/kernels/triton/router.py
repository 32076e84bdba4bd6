"""The MoE router after its linear layer, one program per token: softmax over the experts
in fp32, the top k, their renormalisation, the cast to the activations' dtype.

The torch code is five kernels (softmax, topk, sum, divide, cast); at one token a step
each costs more in launch than in work. Ranking by the probabilities, not the logits, keeps
the reference's order where two logits round to one probability.
"""

import triton
import triton.language as tl


@triton.jit
def topk_softmax_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    E,
    RENORM: tl.constexpr,
    K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + row * E + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    p = e / tl.sum(e, axis=0)
    p = tl.where(offs < E, p, -1.0)  # padding never wins a place
    koffs = tl.arange(0, BLOCK_K)
    vals = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for j in tl.static_range(K):
        best = tl.max(p, axis=0)
        at = tl.min(tl.where(p == best, offs, BLOCK_E), axis=0)  # the lowest index among ties
        vals = tl.where(koffs == j, best, vals)
        ids = tl.where(koffs == j, at.to(tl.int64), ids)
        p = tl.where(offs == at, -1.0, p)
    if RENORM:
        vals = vals / tl.sum(vals, axis=0)
    dt = weights_ptr.dtype.element_ty
    tl.store(weights_ptr + row * K + koffs, vals.to(dt), mask=koffs < K)
    tl.store(ids_ptr + row * K + koffs, ids, mask=koffs < K)
