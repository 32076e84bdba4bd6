"""DeepSeek-V4's compressors: one entry per window of `ratio` tokens, a softmax-gated sum of
the window's tokens, per channel,

    entry_w = rope(norm(Σ_j softmax_j(z_j + B_j) ⊙ c_j), w · ratio)

with c = kv_proj(x), z = gate_proj(x) per token and B a learned bias per position in the
window. With `overlap` (compressed sparse attention) each token gives two series, c = [Ca,
Cb]: entry w pools Ca of window w-1 with Cb of window w, 2·ratio slots, so windows overlap
by half; window 0 has no Ca half. Rope rotates the entry's last rope_dim dimensions (pairs
in place) at the window's first position.

A token's c and z are its compressor inputs (KVLayout `inputs`), kept per token in the pool
until the window is formed; `pool` forms entries from the inputs of each window's span.
`EntryIndexer` is the same compressor at the indexer's width, with the indexer's queries.
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken.layers import indexer
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rope import apply_rope
from freetoken.layers.rope_scaling import RopeScaling, ScaledRotaryEmbedding

__all__ = ["Compressor", "EntryIndexer", "rope_tail"]


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] with its last R dimensions rotated in adjacent pairs by cos/sin
    [T, R] (DeepSeek-V4's heads are [rope-free | rope])."""
    R = cos.shape[-1]
    return torch.cat((x[..., :-R], apply_rope(x[..., -R:], cos, sin, pairs=True)), dim=-1)


class Compressor(nn.Module):
    """kv_proj and gate_proj [H -> c·dim] (c = 2 with overlap), position_bias [ratio, c·dim],
    kv_norm [dim], and the rope of its entries."""

    def __init__(
        self,
        hidden: int,
        dim: int,
        ratio: int,
        overlap: bool,
        eps: float,
        rope_dim: int,
        theta: float,
        scaling: RopeScaling,
    ):
        super().__init__()
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        width = (2 if overlap else 1) * dim
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(ratio, width))
        self.kv_norm = RMSNorm(dim, eps)
        self.rotary = ScaledRotaryEmbedding(rope_dim, theta, scaling, pairs=True)

    @property
    def inputs_dim(self) -> int:
        return 2 * self.position_bias.shape[1]

    @property
    def span(self) -> int:
        """Tokens an entry pools: its window, and with overlap the window before it."""
        return 2 * self.ratio if self.overlap else self.ratio

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """Each token's inputs [T, 2·c·dim]: c then z."""
        return torch.cat((self.kv_proj(x), self.gate_proj(x)), dim=-1)

    def pool(self, raw: torch.Tensor, valid: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        """Entries [N, dim] of windows [N] from the inputs raw [N, span, 2·c·dim] of their
        spans' tokens (first position first); `valid` [N, span] says which tokens exist."""
        width, d, m = self.position_bias.shape[1], self.dim, self.ratio
        kv, gate = raw[..., :width], raw[..., width:].float()
        bias = self.position_bias.float()
        if self.overlap:  # slots [0, m): Ca of the window before; [m, 2m): Cb of this one
            kv = torch.cat((kv[:, :m, :d], kv[:, m:, d:]), dim=1)
            gate = torch.cat((gate[:, :m, :d] + bias[:, :d], gate[:, m:, d:] + bias[:, d:]), 1)
        else:
            gate = gate + bias
        gate = gate.masked_fill(~valid[..., None], float("-inf"))
        weights = torch.softmax(gate, dim=1).nan_to_num().to(kv.dtype)  # no token: no entry
        pooled = self.kv_norm((kv * weights).sum(dim=1))
        cos, sin = self.rotary(windows * m, pooled.dtype)
        return rope_tail(pooled[:, None], cos, sin)[:, 0]


class Scorer(nn.Module):
    """The indexer's per-head weights: weights_proj [H -> heads]."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.weights_proj = nn.Linear(hidden, heads, bias=False)


class EntryIndexer(Compressor):
    """DeepSeek-V4's lightning indexer: its own overlapping compressor forms a key per entry
    (head_dim wide), and its queries q_b_proj(q_resid) [heads, head_dim], rotated at the
    token's position, score them (layers/indexer.py)."""

    def __init__(
        self,
        hidden: int,
        q_lora_rank: int,
        heads: int,
        head_dim: int,
        topk: int,
        ratio: int,
        eps: float,
        rope_dim: int,
        theta: float,
        scaling: RopeScaling,
    ):
        super().__init__(hidden, head_dim, ratio, True, eps, rope_dim, theta, scaling)
        self.heads, self.topk = heads, topk
        self.q_b_proj = nn.Linear(q_lora_rank, heads * head_dim, bias=False)
        self.scorer = Scorer(hidden, heads)

    def queries(
        self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries [T, heads, head_dim] and their weights [T, heads]."""
        q = self.q_b_proj(q_resid).view(x.shape[0], self.heads, self.dim)
        w = self.scorer.weights_proj(x) * self.heads**-0.5
        return rope_tail(q, cos, sin), w

    def choose(
        self,
        q: torch.Tensor,
        w: torch.Tensor,
        keys: torch.Tensor,
        rows: torch.Tensor,
        seen: torch.Tensor,
    ) -> torch.Tensor:
        """The entries [n, min(topk, S)] query i attends to, of the keys in `keys` rows
        rows[i, :seen[i]] (rows [n, S], -1: none), as positions in its list (-1: none)."""
        every = torch.arange(q.shape[0], device=q.device)
        return indexer.choose(q, w, keys, rows, every, seen, self.topk)
