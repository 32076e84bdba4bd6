"""Grouped-query attention over the paged KV pool, with the options families combine:
q/k/v and output projection biases, q/k RMSNorm per head or over the whole projection,
partial rotary, sliding-window attention, attention sinks and an output gate.

A sliding window of w: a query sees the last w keys, itself included (transformers' sliding
mask). Every page stays in the pool; prefill and decode read only the window's keys. A sink
is a learned logit per query head that joins the softmax's denominator and carries no value:
softmax over [scores, sink], the sink's share dropped.

On a GPU the KV write and decode attention run as Triton kernels that read the pool in place
(kernels/triton/attention.py) unless the fused kernels are off; the torch code here is what
they are tested against and what runs everywhere else."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.kernels.triton import block
from freetoken.layers import context, fused
from freetoken.layers.norm import RMSNorm, head_norm_rope
from freetoken.layers.rope import apply_rope

BLOCK_N = 64  # context positions a program takes at a time
SPLIT_TOKENS = 256  # context positions per split of a long decode context (one program each)
MAX_SPLITS = 32
QK_NORMS = ("head", "full")


class Attention(nn.Module):
    """q/k/v projections, rotary embedding, attention over the cache, output projection.

    qk_norm: "head" normalises each head of q and k over head_dim (Qwen3, GLM-4.5; True
        means "head"); "full" normalises the whole q and k projections before the heads are
        split (OLMoE, MiniMax-M2); None or False: no norm.
    bias: the q/k/v projections' biases; o_bias: the output projection's (default: bias).
    clip_qkv: q, k and v clamped to [-clip, clip] after the norm (OLMoE's option).
    rope_pairs: rotate adjacent dimension pairs rather than halves (layers/rope.py).
    window: the keys a query sees, counting itself (0: every key).
    sinks: a learned per-head logit in the softmax's denominator (`sinks` [heads]).
    gate: q_proj also yields a gate per head (its rows, head by head, are that head's q then
        its gate); the attention output is scaled by σ(gate) before o_proj (Qwen3-Next).
    zero_centered: the q/k norms scale by 1 + weight (layers/norm.py).
    scale: what q·k is multiplied by (default 1/√head_dim; Granite sets its own).
    Partial rotary needs no option: the rope tables' width is the rotated width.
    """

    def __init__(
        self,
        layer: int,
        hidden: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        qk_norm: bool | str | None = False,
        bias: bool = False,
        o_bias: bool | None = None,
        eps: float = 1e-6,
        clip_qkv: float | None = None,
        rope_pairs: bool = False,
        window: int = 0,
        sinks: bool = False,
        gate: bool = False,
        zero_centered: bool = False,
        scale: float | None = None,
    ):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.qk_norm = "head" if qk_norm is True else (qk_norm or None)
        if self.qk_norm not in (None, *QK_NORMS):
            raise ValueError(f"unknown q/k norm {qk_norm!r} (one of {QK_NORMS})")
        self.clip_qkv, self.rope_pairs, self.window = clip_qkv, rope_pairs, window
        self.gate = gate
        self.q_proj = nn.Linear(hidden, n_heads * head_dim * (2 if gate else 1), bias=bias)
        self.k_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=bias if o_bias is None else o_bias)
        self.q_norm = self.k_norm = None
        if self.qk_norm is not None:
            full = self.qk_norm == "full"
            self.q_norm = RMSNorm(n_heads * head_dim if full else head_dim, eps, zero_centered)
            self.k_norm = RMSNorm(n_kv_heads * head_dim if full else head_dim, eps, zero_centered)
        self.sinks = nn.Parameter(torch.zeros(n_heads)) if sinks else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        gate = None
        if self.gate:
            q, gate = q.view(T, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
            q = q.reshape(T, -1)  # contiguous again, for the fused norm
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = q.view(T, self.n_heads, self.head_dim)
        k = k.view(T, self.n_kv_heads, self.head_dim)
        v = v.view(T, self.n_kv_heads, self.head_dim)
        q, k = self._rotate(q, k, rope)
        out = self._attend(q, k, v)
        if gate is not None:
            out = out.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))
        return self.o_proj(out.reshape(T, -1))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] into the pool, then attention over it: [T, H, D]."""
        ctx = context.current()
        k_cache, v_cache = ctx.kv.k[self.layer], ctx.kv.v[self.layer]
        store_kv(k, v, ctx.slots, k_cache, v_cache)
        if ctx.decode is not None:
            return decode_attention(
                q, k_cache, v_cache, ctx.decode, self.scale, self.window, self.sinks
            )
        out = torch.empty_like(q)
        for s in ctx.seqs:
            out[s.q_start : s.q_start + s.q_len] = prefill_attention(
                q[s.q_start : s.q_start + s.q_len],
                k_cache[s.ctx_slots],
                v_cache[s.ctx_slots],
                s.ctx_len,
                self.scale,
                self.window,
                self.sinks,
            )
        return out

    def _rotate(
        self, q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q/k [T, heads, D], normed per head where the layer does so, then rotated."""
        cos, sin = rope
        if self.qk_norm == "head" and not self.rope_pairs:  # one kernel on a GPU
            zc = self.q_norm.zero_centered
            q = head_norm_rope(q, self.q_norm.weight, self.q_norm.eps, cos, sin, zc)
            return q, head_norm_rope(k, self.k_norm.weight, self.k_norm.eps, cos, sin, zc)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin, self.rope_pairs), apply_rope(k, cos, sin, self.rope_pairs)


def _flash_lower_right(q: torch.Tensor) -> bool:
    """Whether SDPA takes a bottom-right causal bias in its flash kernel here (CUDA, half
    types; with GQA too): elsewhere it would warn and build the mask anyway."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def _prefill_mask(n: int, ctx_len: int, lo: int, window: int, device: torch.device) -> torch.Tensor:
    """[n, ctx_len - lo]: query i (at position ctx_len - n + i) sees key j (at lo + j)."""
    qpos = torch.arange(ctx_len - n, ctx_len, device=device)[:, None]
    kpos = torch.arange(lo, ctx_len, device=device)[None, :]
    mask = kpos <= qpos
    if window:
        mask &= kpos > qpos - window
    return mask


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx_len: int,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [n, H, D] for the last n positions of a context of ctx_len; k/v [ctx_len, KVH, D].
    Keys no query of the chunk can see (before the first query's window) are not read."""
    n = q.shape[0]
    lo = max(0, ctx_len - n - window + 1) if window else 0
    # 4-D inputs with enable_gqa let SDPA pick a fused kernel and skip repeating K/V per head
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    kh = k[lo:].to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, KVH, S, D]
    vh = v[lo:].to(q.dtype).transpose(0, 1).unsqueeze(0)
    mask, causal = None, False
    if n > 1:
        unwindowed = (not window or window >= ctx_len) and sinks is None
        if unwindowed and n == ctx_len:
            causal = True
        elif unwindowed and _flash_lower_right(q):
            # A later chunk, or a suffix after a cached prefix: causal aligned to the last
            # key. An explicit [n, ctx_len] mask would rule out the flash kernel, and SDPA's
            # fallback reads the whole score matrix (most of a 15k-token agent's second turn).
            # imported here: the module pulls in torch's compiler (2 s at every start)
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(n, ctx_len)
        else:
            mask = _prefill_mask(n, ctx_len, lo, window, q.device)
    if sinks is not None:
        o = sdpa_with_sinks(qh, kh, vh, mask, scale, sinks)
    else:
        o = F.scaled_dot_product_attention(
            qh,
            kh,
            vh,
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=qh.shape[1] != kh.shape[1],
        )
    return o[0].transpose(0, 1)


def sdpa_with_sinks(
    qh: torch.Tensor,
    kh: torch.Tensor,
    vh: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """SDPA with a sink per query head: qh [B, H, n, D], kh/vh [B, KVH, S, D], mask broadcast
    to [B, H, n, S] (True: visible) or None.

    The sink becomes a key every query sees: q gains a dimension holding sink/scale, a key
    of zeros with a 1 there is put first, its value zero. Its score is then the sink, GQA's
    shared keys still serve every head, and SDPA's fused kernels still run.

    v is widened with zeros to q and k's width and the output cut back, so that the call has
    one head dim, the form CUDA's fused kernels are known exact on: an fp32 call with GQA
    and a mask runs the memory-efficient kernel, and on an H200 gpt-oss's prefill (v
    narrower than q/k) was wrong where Mixtral's (GQA, a window's mask, one head dim) and
    MLA's (no GQA, v narrower) were exact. Zero columns add exact zeros: every backend
    gives the same first Dv columns."""
    B, H, n, D = qh.shape
    KVH, S, Dv = kh.shape[1], kh.shape[2], vh.shape[-1]
    W = -(-max(D + 1, Dv) // 8) * 8  # the kernels want head dims in multiples of 8
    qa = qh.new_zeros((B, H, n, W))
    qa[..., :D] = qh
    qa[..., D] = (sinks.float() / scale).to(qh.dtype)[None, :, None]
    ka = kh.new_zeros((B, KVH, S + 1, W))
    ka[:, :, 1:, :D] = kh
    ka[:, :, 0, D] = 1.0
    va = vh.new_zeros((B, KVH, S + 1, W))
    va[:, :, 1:, :Dv] = vh
    if mask is not None:
        mask = torch.cat((mask.new_ones((*mask.shape[:-1], 1)), mask), dim=-1)
    out = F.scaled_dot_product_attention(
        qa, ka, va, attn_mask=mask, scale=scale, enable_gqa=H != KVH
    )
    return out[..., :Dv]


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """k, v [T, KVH, D] into the pool's slots [T]."""
    if fused.usable(k, v) and fused.usable(k_cache, v_cache) and slots.is_contiguous():
        from freetoken.kernels.triton import attention as kernels

        W = k.shape[1] * k.shape[2]
        kernels.store_kv_kernel[(k.shape[0],)](k, v, slots, k_cache, v_cache, W=W, BLOCK=block(W))
        return
    k_cache[slots] = k.to(k_cache.dtype)
    v_cache[slots] = v.to(v_cache.dtype)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    d: context.DecodeView,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, D], one token per sequence, over each sequence's first d.lens[b] context
    positions (the last `window` of them with a window), found through the block table."""
    B, H, D = q.shape
    KVH = k_cache.shape[1]
    fits = D == block(D) and D >= 16 and H % KVH == 0
    if fits and fused.usable(q, k_cache, v_cache, *(() if sinks is None else (sinks,))):
        return _decode_fused(q, k_cache, v_cache, d, scale, window, sinks)
    if d.ctx_slots is None:
        d.derive()
    kh = k_cache[d.ctx_slots].to(q.dtype).transpose(1, 2)  # [B, KVH, max_ctx, D]
    vh = v_cache[d.ctx_slots].to(q.dtype).transpose(1, 2)
    mask = d.mask
    if window:
        pos = torch.arange(mask.shape[-1], device=mask.device)
        mask = mask & (pos[None, :] >= (d.lens - window)[:, None])[:, None, None, :]
    if sinks is not None:
        return sdpa_with_sinks(q.unsqueeze(2), kh, vh, mask, scale, sinks).squeeze(2)
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), kh, vh, attn_mask=mask, scale=scale, enable_gqa=H != KVH
    )
    return o.squeeze(2)


def decode_splits(d: context.DecodeView, window: int = 0) -> int:
    """Programs per (sequence, KV head): they follow the padded length (or the window, if
    shorter), fixed for a captured step; each spreads the actual one."""
    span = d.block_table.shape[1] * d.page_size
    if window:
        span = min(span, window)
    return max(1, min(MAX_SPLITS, -(-span // SPLIT_TOKENS)))


def _decode_fused(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    d: context.DecodeView,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    from freetoken.kernels.triton import attention as kernels

    B, H, D = q.shape
    KVH = k_cache.shape[1]
    G = H // KVH
    splits = decode_splits(d, window)
    # split outputs are merged by their log-sum-exp; a sink is one more term of that merge
    rows = splits + (sinks is not None)
    out = torch.empty_like(q)
    part = lse = out
    if splits > 1:
        part = torch.empty((B, H, rows, D), dtype=torch.float32, device=q.device)
        lse = torch.empty((B, H, rows), dtype=torch.float32, device=q.device)
    kernels.decode_attention_kernel[(B, KVH, splits)](
        q,
        k_cache,
        v_cache,
        d.block_table,
        d.lens,
        out,
        part,
        lse,
        sinks,
        scale,
        d.block_table.stride(0),
        H,
        KVH,
        splits,
        GROUP=G,
        G_BLOCK=max(16, block(G)),
        D=D,
        PAGE=d.page_size,
        BLOCK_N=BLOCK_N,
        DIRECT=splits == 1,
        WINDOW=window,
    )
    if splits > 1:
        kernels.merge_splits_kernel[(B * H,)](
            part, lse, out, rows, D=D, S_BLOCK=max(2, block(rows))
        )
    return out
