"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash) over the paged KV pool.

Keys and values come from one low-rank latent per token: kv_a_proj_with_mqa gives the
compressed kv c [r] (r = kv_lora_rank, normalised by kv_a_layernorm) and a rotary key k_pe
[dr] shared by every head; kv_b_proj expands c into each head's rope-free key [dn] and value
[dv]. The cache keeps only the latent, [c, rope(k_pe)] (KVLayout.latent(r + dr)), so a
token costs r + dr values in every layer instead of heads × (dn + dr + dv).

Prefill (and the torch decode) expands the cached latents through kv_b_proj and attends as
usual. Decode on a GPU runs the absorbed form: with W_UK, W_UV the key and value halves of
kv_b_proj per head, q_nope·k_nope = (q_nope W_UK)·c and the output is (p·c) W_UVᵀ, so a
Triton kernel (kernels/triton/mla.py) attends over the latents in the pool in place, one
query of r + dr per head, and the expansion is two small per-head matmuls around it.

Checkpoints hold kv_b_proj whole ([H·(dn + dv), r], Hugging Face) or split per head
(llama.cpp's attn_k_b [H, r, dn] and attn_v_b [H, dv, r]); `split_kv_b` picks the second.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.kernels.triton import block
from freetoken.layers import context, fused
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rope import apply_rope
from freetoken.layers.rope_scaling import apply_rope_interleaved

__all__ = ["LATENT_NORM_EPS", "MLAttention", "decode_latent_attention"]

# q_a_layernorm and kv_a_layernorm keep RMSNorm's default epsilon whatever the model's own
LATENT_NORM_EPS = 1e-6
SPLIT_TOKENS = 256  # context positions per split of a long decode context (one program each)
MAX_SPLITS = 32
HEAD_BLOCK = 16  # query heads a kernel program serves (the latents are read once for them)


class PerHead(nn.Module):
    """One per-head weight [H, a, b] (llama.cpp's split halves of kv_b_proj)."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape))


class MLAttention(nn.Module):
    def __init__(
        self,
        layer: int,
        hidden: int,
        n_heads: int,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
        bias: bool = False,
        interleaved: bool = True,
        split_kv_b: bool = False,
    ):
        super().__init__()
        self.layer, self.n_heads, self.scale = layer, n_heads, scale
        self.r, self.dn, self.dr, self.dv = (
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
        )
        self.interleaved, self.split_kv_b = interleaved, split_kv_b
        self.q_lora_rank = q_lora_rank or None
        q_dim = n_heads * (qk_nope_head_dim + qk_rope_head_dim)
        if q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(q_lora_rank, q_dim, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, q_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        if split_kv_b:
            self.k_b_proj = PerHead(n_heads, kv_lora_rank, qk_nope_head_dim)
            self.v_b_proj = PerHead(n_heads, v_head_dim, kv_lora_rank)
        else:
            self.kv_b_proj = nn.Linear(
                kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False
            )
        self.o_proj = nn.Linear(n_heads * v_head_dim, hidden, bias=bias)

    # --- the per-head halves of kv_b_proj -------------------------------------------------
    def w_uk(self) -> torch.Tensor:
        """[H, dn, r]: c -> each head's rope-free key."""
        if self.split_kv_b:
            return self.k_b_proj.weight.transpose(1, 2)
        return self.kv_b_proj.weight.view(self.n_heads, self.dn + self.dv, self.r)[:, : self.dn]

    def w_uv(self) -> torch.Tensor:
        """[H, dv, r]: c -> each head's value."""
        if self.split_kv_b:
            return self.v_b_proj.weight
        return self.kv_b_proj.weight.view(self.n_heads, self.dn + self.dv, self.r)[:, self.dn :]

    def expand(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents c [S, r] -> rope-free keys [S, H, dn] and values [S, H, dv]."""
        if not self.split_kv_b:
            kv = self.kv_b_proj(c).view(c.shape[0], self.n_heads, self.dn + self.dv)
            return kv[..., : self.dn], kv[..., self.dn :]
        return torch.einsum("sr,hnr->shn", c, self.w_uk()), torch.einsum(
            "sr,hvr->shv", c, self.w_uv()
        )

    # --- forward ----------------------------------------------------------------------------
    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope_interleaved(x, cos, sin) if self.interleaved else apply_rope(x, cos, sin)

    def _query(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The queries [T, H·(dn + dr)] and, with a low-rank q, the normalised compressed
        query they come from (a sparse attention's indexer reads it too)."""
        if self.q_lora_rank is None:
            return self.q_proj(x), None
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        return self.q_b_proj(q_resid), q_resid

    def _store_latent(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[context.StepContext, torch.Tensor]:
        """Writes each new token's latent [c, rope(k_pe)] into the pool; the step context
        and the layer's pool [slots, 1, r + dr]."""
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.r, self.dr], dim=-1)
        latent = torch.cat((self.kv_a_layernorm(c), self._rope(k_pe[:, None], cos, sin)[:, 0]), -1)
        ctx = context.current()
        cache = ctx.kv.k[self.layer]
        cache[ctx.slots] = latent[:, None].to(cache.dtype)
        return ctx, cache

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        T = x.shape[0]
        cos, sin = rope
        q = self._query(x)[0].view(T, self.n_heads, self.dn + self.dr)
        q_nope, q_pe = q[..., : self.dn], self._rope(q[..., self.dn :], cos, sin)
        ctx, cache = self._store_latent(x, cos, sin)
        if ctx.decode is not None:
            out = self._decode(q_nope, q_pe, cache, ctx.decode)
        else:
            out = torch.empty((T, self.n_heads, self.dv), dtype=x.dtype, device=x.device)
            for s in ctx.seqs:
                rows = slice(s.q_start, s.q_start + s.q_len)
                out[rows] = self._attend(q_nope[rows], q_pe[rows], cache[s.ctx_slots, 0], s.ctx_len)
        return self.o_proj(out.reshape(T, -1))

    def _keys_values(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached latents [S, r + dr] -> keys [S, H, dn + dr] and values [S, H, dv]."""
        S = latents.shape[0]
        k_nope, v = self.expand(latents[:, : self.r])
        k_pe = latents[:, None, self.r :].expand(S, self.n_heads, self.dr)
        return torch.cat((k_nope, k_pe), dim=-1), v

    def _attend(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor, ctx_len: int
    ) -> torch.Tensor:
        """The last n positions of a context of ctx_len, over its latents [ctx_len, r + dr]."""
        n = q_nope.shape[0]
        k, v = self._keys_values(latents.to(q_nope.dtype))
        q = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)  # [H, n, dn + dr]
        mask, causal = None, False
        if n == ctx_len and n > 1:
            causal = True
        elif n > 1:
            qpos = torch.arange(ctx_len - n, ctx_len, device=q.device)[:, None]
            mask = torch.arange(ctx_len, device=q.device)[None, :] <= qpos
        o = F.scaled_dot_product_attention(
            q,
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask,
            is_causal=causal,
            scale=self.scale,
        )
        return o.transpose(0, 1)  # [n, H, dv]

    def _decode(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, d: context.DecodeView
    ) -> torch.Tensor:
        """One token per sequence (q [B, H, *]) over the first d.lens[b] positions."""
        if kernel_usable(q_nope, cache):
            return self._decode_absorbed(q_nope, q_pe, cache, d)
        if d.ctx_slots is None:
            d.derive()
        B, S = d.ctx_slots.shape
        k, v = self._keys_values(cache[d.ctx_slots.reshape(-1), 0].to(q_nope.dtype))
        k = k.view(B, S, self.n_heads, -1).transpose(1, 2)  # [B, H, S, dn + dr]
        v = v.view(B, S, self.n_heads, -1).transpose(1, 2)
        q = torch.cat((q_nope, q_pe), dim=-1).unsqueeze(2)  # [B, H, 1, dn + dr]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=d.mask, scale=self.scale)
        return o.squeeze(2)

    def _decode_absorbed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, d: context.DecodeView
    ) -> torch.Tensor:
        """q_nope absorbed into W_UK, attention over the latents in place, out through W_UV."""
        q_abs = torch.einsum("bhn,hnr->bhr", q_nope, self.w_uk().to(q_nope.dtype))
        o = decode_latent_attention(q_abs.contiguous(), q_pe.contiguous(), cache, d, self.scale)
        return torch.einsum("bhr,hvr->bhv", o, self.w_uv().to(o.dtype))


def kernel_usable(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether decode runs the absorbed form's kernel: a GPU pool with the fused kernels on,
    queries of its dtype (they are made contiguous for it)."""
    return fused.usable(cache) and q.is_cuda and q.dtype == cache.dtype


def decode_latent_attention(
    q_abs: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    d: context.DecodeView,
    scale: float,
) -> torch.Tensor:
    """Softmax((q_abs·c + q_pe·k_pe)·scale) · c for each sequence's latents in the pool.

    q_abs [B, H, r], q_pe [B, H, dr], cache [slots, 1, r + dr] -> [B, H, r] (the kernel;
    the torch code below is its reference)."""
    from freetoken.kernels.triton import mla as kernels

    B, H, R = q_abs.shape
    P = q_pe.shape[-1]
    # splits follow the padded length, fixed for a captured step; each spreads the actual one
    splits = min(MAX_SPLITS, -(-d.block_table.shape[1] * d.page_size // SPLIT_TOKENS))
    out = torch.empty_like(q_abs)
    part = lse = out
    if splits > 1:
        part = torch.empty((B, H, splits, R), dtype=torch.float32, device=q_abs.device)
        lse = torch.empty((B, H, splits), dtype=torch.float32, device=q_abs.device)
    R_BLOCK = max(16, block(R))
    kernels.mla_decode_kernel[(B, -(-H // HEAD_BLOCK), splits)](
        q_abs,
        q_pe,
        cache,
        d.block_table,
        d.lens,
        out,
        part,
        lse,
        scale,
        d.block_table.stride(0),
        H,
        splits,
        R=R,
        R_BLOCK=R_BLOCK,
        P=P,
        P_BLOCK=max(16, block(P)),
        HB=HEAD_BLOCK,
        PAGE=d.page_size,
        BLOCK_N=32 if R_BLOCK <= 256 else 16,
        DIRECT=splits == 1,
    )
    if splits > 1:
        kernels.mla_merge_kernel[(B * H,)](
            part, lse, out, splits, R=R, R_BLOCK=R_BLOCK, S_BLOCK=max(2, block(splits))
        )
    return out


def latent_attention_reference(
    q_abs: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    d: context.DecodeView,
    scale: float,
) -> torch.Tensor:
    """The absorbed attention in torch (what the kernel computes), in fp32."""
    if d.ctx_slots is None:
        d.derive()
    R = q_abs.shape[-1]
    lat = cache[d.ctx_slots, 0].float()  # [B, S, r + dr]
    s = torch.einsum("bhr,bsr->bhs", q_abs.float(), lat[..., :R])
    s = (s + torch.einsum("bhp,bsp->bhs", q_pe.float(), lat[..., R:])) * scale
    s = s.masked_fill(~d.mask[:, 0], float("-inf"))
    return torch.einsum("bhs,bsr->bhr", torch.softmax(s, dim=-1), lat[..., :R]).to(q_abs.dtype)
