"""Sparse attention over chosen rows of the paged pool: each query token has its own list
of rows (a row index of the layer's pool, -1 for none), and every head attends over them.

One KV head serves every query head (MQA), as in multi-head latent attention absorbed
(GLM-5: a row is [c, k_pe], the value its first r values) and DeepSeek-V4's compressed
attention (a row is key and value alike, with a learned sink per head in the softmax's
denominator):

    o[t, h] = Σ_j softmax_j(q[t, h] · K[rows[t, j]] · scale ; sink[h]) · K[rows[t, j], :dv]

Which rows a query reads is the model's choice (its indexer's top-k, a sliding window, its
compressed entries); `rows_of` turns per-query context positions into pool rows for both
kinds of step. On a GPU with the fused kernels on, one Triton kernel reads the rows in place
(kernels/triton/sparse.py), a program per (token, block of heads), long lists cut into
splits merged by their log-sum-exp, for decode steps and prefill chunks alike; the torch
code here is its reference and what runs everywhere else.
"""

from __future__ import annotations

import torch

from freetoken.kernels.triton import block
from freetoken.layers import context, fused

__all__ = ["attend", "reference", "rows_of"]

HEAD_BLOCK = 16  # query heads a kernel program serves (a row is read once for them)
SPLIT_ROWS = 256  # rows per split of a long list (one program each)
MAX_SPLITS = 16
QUERY_BLOCK = 64  # queries the torch code gathers rows for at a time (bounds its memory)


def rows_of(positions: torch.Tensor) -> torch.Tensor:
    """Context positions [T, K] of each query token's sequence (-1: none) -> token rows of
    the pool, through the step's slots: the fixed-shape decode view's, or each sequence's."""
    ctx = context.current()
    keep = positions >= 0
    at = positions.clamp(min=0)
    d = ctx.decode
    if d is not None:
        if d.ctx_slots is None:
            d.derive()
        rows = d.ctx_slots.gather(1, at.clamp(max=d.ctx_slots.shape[1] - 1))
    else:
        rows = torch.empty_like(positions)
        for s in ctx.seqs:
            q = slice(s.q_start, s.q_start + s.q_len)
            rows[q] = s.ctx_slots[at[q].clamp(max=s.ctx_len - 1)]
    return torch.where(keep, rows, -1)


def attend(
    q: torch.Tensor,
    pool: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
    dv: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D]; pool [N, 1, D'] (D' >= D: the first D values are the key, the first dv
    the value); rows [T, K] -> [T, H, dv] in q's dtype."""
    if kernel_usable(q, pool):
        return _kernel(q, pool, rows, scale, dv, sinks)
    return reference(q, pool, rows, scale, dv, sinks)


def kernel_usable(q: torch.Tensor, pool: torch.Tensor) -> bool:
    return fused.usable(pool) and q.is_cuda and q.dtype == pool.dtype


def reference(
    q: torch.Tensor,
    pool: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
    dv: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel's definition in torch (fp32 scores and sums), a block of queries at a
    time."""
    T, H, D = q.shape
    out = torch.empty((T, H, dv), dtype=q.dtype, device=q.device)
    for lo in range(0, T, QUERY_BLOCK):
        r = rows[lo : lo + QUERY_BLOCK]
        keys = pool[r.clamp(min=0), 0].float()  # [n, K, D']
        s = torch.einsum("nhd,nkd->nhk", q[lo : lo + QUERY_BLOCK].float(), keys[..., :D]) * scale
        s = s.masked_fill((r < 0)[:, None, :], float("-inf"))
        if sinks is not None:
            sink = sinks.float()[None, :, None].expand(s.shape[0], H, 1)
            p = torch.softmax(torch.cat((s, sink), dim=-1), dim=-1)[..., :-1]
        else:
            p = torch.softmax(s, dim=-1)
        out[lo : lo + QUERY_BLOCK] = torch.einsum("nhk,nkd->nhd", p, keys[..., :dv]).to(q.dtype)
    return out


def _kernel(
    q: torch.Tensor,
    pool: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
    dv: int,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    from freetoken.kernels.triton import sparse as kernels

    T, H, D = q.shape
    K = rows.shape[1]
    rows = rows.to(torch.int32).contiguous()
    q = q.contiguous()
    # splits follow the list's length, fixed for a captured step
    splits = max(1, min(MAX_SPLITS, -(-K // SPLIT_ROWS)))
    out = torch.empty((T, H, dv), dtype=q.dtype, device=q.device)
    part = lse = out
    if splits > 1:
        part = torch.empty((T, H, splits, dv), dtype=torch.float32, device=q.device)
        lse = torch.empty((T, H, splits), dtype=torch.float32, device=q.device)
    DV_BLOCK = max(16, block(dv))
    sink = sinks.float().contiguous() if sinks is not None else out
    kernels.sparse_attention_kernel[(T, -(-H // HEAD_BLOCK), splits)](
        q,
        pool,
        rows,
        sink,
        out,
        part,
        lse,
        scale,
        pool.stride(0),
        H,
        K,
        splits,
        D=D,
        DV=dv,
        DV_BLOCK=DV_BLOCK,
        DR_BLOCK=max(16, block(D - dv)) if D > dv else 16,
        HB=HEAD_BLOCK,
        BLOCK_N=32 if DV_BLOCK <= 256 else 16,
        HAS_SINK=sinks is not None,
        DIRECT=splits == 1,
    )
    if splits > 1:
        kernels.sparse_merge_kernel[(T * H,)](
            part,
            lse,
            sink,
            out,
            H,
            splits,
            DV=dv,
            DV_BLOCK=DV_BLOCK,
            S_BLOCK=max(2, block(splits)),
            HAS_SINK=sinks is not None,
        )
    return out
