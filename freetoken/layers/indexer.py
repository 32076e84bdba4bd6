"""The lightning indexer of DeepSeek's sparse attention (GLM-5 over every cached token,
DeepSeek-V4 over its compressed entries): a few small query heads score each key a query
may see,

    I[t, s] = Σ_h w[t, h] · relu(q[t, h] · k[s]) · d^-1/2,   w = weights_proj(x) · heads^-1/2

and the query attends only to the `topk` visible keys of highest score. The keys (d wide,
one per token or entry) sit in the pool's index rows (KVLayout.index_dim) beside what they
stand for.

`list_scores` and `choose` are the shared math, over lists of pool rows as sparse attention
takes them (one Triton kernel on a GPU reads the keys in place); `TokenIndexer` is GLM-5's
module, with its own projections and a key per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.kernels.triton import block
from freetoken.layers import context, fused
from freetoken.layers.rope_scaling import apply_rope_interleaved

__all__ = ["TokenIndexer", "choose", "list_scores", "prefix_top_k", "scores", "top_k"]

SCORE_BUDGET = 1 << 25  # query-head-key products a block of prefill queries may hold at once


def scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [n, h, d], w [n, h] (weights_proj's, scaled), keys [S, d] or [n, S, d] -> [n, S],
    in fp32."""
    scale = q.shape[-1] ** -0.5
    q, keys = q.float(), keys.float()
    if keys.dim() == 2:
        dots = torch.einsum("nhd,sd->nhs", q, keys)
    else:
        dots = torch.einsum("nhd,nsd->nhs", q, keys)
    return torch.einsum("nhs,nh->ns", F.relu(dots) * scale, w.float())


def list_scores(
    q: torch.Tensor,
    w: torch.Tensor,
    pool: torch.Tensor,
    lists: torch.Tensor,
    which: torch.Tensor,
    seen: torch.Tensor,
) -> torch.Tensor:
    """Scores [n, S] of the keys in pool rows lists[which[i], :seen[i]] (lists [L, S], -1:
    none) for query i, -inf for the rest: on a GPU one kernel reading the keys in place
    (kernels/triton/indexer.py), else the torch code below, its reference."""
    if kernel_usable(q, pool):
        return _list_scores_kernel(q, w, pool, lists, which, seen)
    S = lists.shape[1]
    keys = pool[lists.clamp(min=0), 0, : q.shape[-1]]  # [L, S, d]
    found = scores(q, w, keys[0] if lists.shape[0] == 1 else keys[which])
    visible = (torch.arange(S, device=q.device)[None, :] < seen[:, None]) & (lists[which] >= 0)
    return found.masked_fill(~visible, float("-inf"))


def kernel_usable(q: torch.Tensor, pool: torch.Tensor) -> bool:
    return fused.usable(pool) and q.is_cuda and q.dtype == pool.dtype


def _list_scores_kernel(q, w, pool, lists, which, seen) -> torch.Tensor:
    from freetoken.kernels.triton import indexer as kernels

    n, h, d = q.shape
    S = lists.shape[1]
    out = torch.empty((n, S), dtype=torch.float32, device=q.device)
    lists = lists.to(torch.int32).contiguous()
    BLOCK_S = 64
    kernels.index_scores_kernel[(n, -(-S // BLOCK_S))](
        q.contiguous(),
        w.float().contiguous(),
        pool,
        lists,
        which.to(torch.int32).contiguous(),
        seen.to(torch.int32).contiguous(),
        out,
        d**-0.5,
        pool.stride(0),
        lists.stride(0),
        S,
        HEADS=h,
        H_BLOCK=max(16, block(h)),
        D=d,
        D_BLOCK=max(16, block(d)),
        BLOCK_S=BLOCK_S,
    )
    return out


def top_k(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """The positions [n, min(k, S)] of each row's k best visible scores; -1 where fewer
    than k are visible."""
    k = min(k, scores.shape[-1])
    best = scores.masked_fill(~visible, float("-inf")).topk(k, dim=-1)
    return torch.where(visible.gather(1, best.indices), best.indices, -1)


def choose(
    q: torch.Tensor,
    w: torch.Tensor,
    pool: torch.Tensor,
    lists: torch.Tensor,
    which: torch.Tensor,
    seen: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """Each query's k best keys of its list (list_scores'), as positions in the list [n,
    min(k, S)]; -1 where it sees fewer."""
    found = list_scores(q, w, pool, lists, which, seen)
    return top_k(found, found > float("-inf"), k)


def prefix_top_k(
    q: torch.Tensor,
    w: torch.Tensor,
    pool: torch.Tensor,
    rows: torch.Tensor,
    k: int,
    seen: torch.Tensor,
) -> torch.Tensor:
    """The k best of one sequence's keys (pool rows `rows` [S]) for each of its queries,
    query i seeing the first seen[i] of them; a block of queries at a time, so a long
    context's prefill never holds every query's scores."""
    n, h = w.shape
    S = rows.shape[0]
    out = torch.full((n, min(k, S)), -1, dtype=torch.long, device=q.device)
    step = max(1, SCORE_BUDGET // max(1, h * S))
    lists, which = rows[None], torch.zeros(n, dtype=torch.long, device=q.device)
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        out[lo:hi] = choose(q[lo:hi], w[lo:hi], pool, lists, which[lo:hi], seen[lo:hi], k)
    return out


class TokenIndexer(nn.Module):
    """GLM-5's indexer: queries from the attention's compressed query (q_resid), a key per
    token from the hidden state through a LayerNorm, both rotated on their first rope_dim
    dimensions (DeepSeek's interleaved pairs) by the attention's rope tables."""

    def __init__(
        self,
        layer: int,
        hidden: int,
        q_lora_rank: int,
        heads: int,
        head_dim: int,
        rope_dim: int,
        topk: int,
    ):
        super().__init__()
        self.layer, self.heads, self.head_dim = layer, heads, head_dim
        self.rope_dim, self.topk = rope_dim, topk
        self.wq_b = nn.Linear(q_lora_rank, heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden, heads, bias=False)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rope_dim
        return torch.cat((apply_rope_interleaved(x[..., :r], cos, sin), x[..., r:]), dim=-1)

    def forward(
        self, x: torch.Tensor, q_resid: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """Each token's chosen context positions [T, K] (-1: none); writes its key."""
        T = x.shape[0]
        cos, sin = rope
        q = self._rope(self.wq_b(q_resid).view(T, self.heads, self.head_dim), cos, sin)
        k = self._rope(self.k_norm(self.wk(x))[:, None], cos, sin)
        w = self.weights_proj(x) * self.heads**-0.5
        ctx = context.current()
        pool = ctx.kv.index[self.layer]  # [rows, 1, d]
        pool[ctx.slots] = k.to(pool.dtype)
        d = ctx.decode
        if d is not None:
            if d.ctx_slots is None:
                d.derive()
            every = torch.arange(T, device=x.device)
            return choose(q, w, pool, d.ctx_slots, every, d.lens, self.topk)
        width = min(self.topk, max(s.ctx_len for s in ctx.seqs))
        out = torch.full((T, width), -1, dtype=torch.long, device=x.device)
        for s in ctx.seqs:
            rows = slice(s.q_start, s.q_start + s.q_len)
            seen = torch.arange(s.ctx_len - s.q_len, s.ctx_len, device=x.device) + 1
            got = prefix_top_k(q[rows], w[rows], pool, s.ctx_slots, self.topk, seen)
            out[rows, : got.shape[1]] = got
        return out
