"""The lightning indexer of DeepSeek's sparse attention (GLM-5 over every cached token,
DeepSeek-V4 over its compressed entries): a few small query heads score each key a query
may see,

    I[t, s] = Σ_h w[t, h] · relu(q[t, h] · k[s]) · d^-1/2,   w = weights_proj(x) · heads^-1/2

and the query attends only to the `topk` visible keys of highest score. The keys (d wide,
one per token or entry) sit in the pool's index rows (KVLayout.index_dim) beside what they
stand for.

`scores` and `top_k` are the shared math; `TokenIndexer` is GLM-5's module, with its own
projections and a key per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.layers import context
from freetoken.layers.rope_scaling import apply_rope_interleaved

__all__ = ["TokenIndexer", "prefix_top_k", "scores", "top_k"]

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


def top_k(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """The positions [n, min(k, S)] of each row's k best visible scores; -1 where fewer
    than k are visible."""
    k = min(k, scores.shape[-1])
    best = scores.masked_fill(~visible, float("-inf")).topk(k, dim=-1)
    return torch.where(visible.gather(1, best.indices), best.indices, -1)


def prefix_top_k(
    q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, k: int, seen: torch.Tensor
) -> torch.Tensor:
    """The k best of one sequence's keys [S, d] for each of its queries, query i seeing the
    first seen[i] of them; a block of queries at a time, so a long context's prefill never
    holds every query's scores."""
    n, h = w.shape
    S = keys.shape[0]
    out = torch.full((n, min(k, S)), -1, dtype=torch.long, device=q.device)
    step = max(1, SCORE_BUDGET // max(1, h * S))
    pos = torch.arange(S, device=q.device)
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        visible = pos[None, :] < seen[lo:hi, None]
        out[lo:hi] = top_k(scores(q[lo:hi], w[lo:hi], keys), visible, k)
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
            found = scores(q, w, pool[d.ctx_slots, 0])
            return top_k(found, d.mask[:, 0, 0], self.topk)
        width = min(self.topk, max(s.ctx_len for s in ctx.seqs))
        out = torch.full((T, width), -1, dtype=torch.long, device=x.device)
        for s in ctx.seqs:
            rows = slice(s.q_start, s.q_start + s.q_len)
            seen = torch.arange(s.ctx_len - s.q_len, s.ctx_len, device=x.device) + 1
            got = prefix_top_k(q[rows], w[rows], pool[s.ctx_slots, 0], self.topk, seen)
            out[rows, : got.shape[1]] = got
        return out
