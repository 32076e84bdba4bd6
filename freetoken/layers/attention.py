"""Grouped-query attention over the paged KV pool, with optional per-head q/k RMSNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.layers import context
from freetoken.layers.norm import RMSNorm, head_norm_rope
from freetoken.layers.rope import apply_rope


class Attention(nn.Module):
    def __init__(self, layer: int, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, *,
                 qk_norm: bool = False, bias: bool = False, eps: float = 1e-6):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(hidden, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.n_kv_heads, self.head_dim)
        cos, sin = rope
        if self.q_norm is not None:
            q = head_norm_rope(q, self.q_norm.weight, self.q_norm.eps, cos, sin)
            k = head_norm_rope(k, self.k_norm.weight, self.k_norm.eps, cos, sin)
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        ctx = context.current()
        k_cache, v_cache = ctx.kv.k[self.layer], ctx.kv.v[self.layer]
        k_cache[ctx.slots] = k.to(k_cache.dtype)
        v_cache[ctx.slots] = v.to(v_cache.dtype)
        if ctx.decode is not None:
            return self.o_proj(self._attend_decode(q, k_cache, v_cache, ctx.decode).reshape(T, -1))
        out = torch.empty_like(q)
        for s in ctx.seqs:
            out[s.q_start:s.q_start + s.q_len] = self._attend(
                q[s.q_start:s.q_start + s.q_len], k_cache[s.ctx_slots], v_cache[s.ctx_slots], s.ctx_len)
        return self.o_proj(out.reshape(T, -1))

    def _attend_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       d: "context.DecodeView") -> torch.Tensor:
        """q: [B, H, D], one token per sequence, over padded contexts masked by length."""
        kh = k_cache[d.ctx_slots].to(q.dtype).transpose(1, 2)  # [B, KVH, max_ctx, D]
        vh = v_cache[d.ctx_slots].to(q.dtype).transpose(1, 2)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), kh, vh, attn_mask=d.mask, scale=self.scale,
                                           enable_gqa=self.n_heads != self.n_kv_heads)
        return o.squeeze(2)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int) -> torch.Tensor:
        """q: [n, H, D] for the last n positions of a context of ctx_len; k/v: [ctx_len, KVH, D]."""
        n = q.shape[0]
        # 4-D inputs with enable_gqa let SDPA pick a fused kernel and skip repeating K/V per head
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        kh = k.to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, KVH, S, D]
        vh = v.to(q.dtype).transpose(0, 1).unsqueeze(0)
        mask, causal = None, False
        if n == ctx_len and n > 1:
            causal = True
        elif n > 1:
            # query i sits at position ctx_len - n + i and sees keys up to it
            qpos = torch.arange(ctx_len - n, ctx_len, device=q.device)[:, None]
            mask = torch.arange(ctx_len, device=q.device)[None, :] <= qpos
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal, scale=self.scale,
                                           enable_gqa=self.n_heads != self.n_kv_heads)
        return o[0].transpose(0, 1)
