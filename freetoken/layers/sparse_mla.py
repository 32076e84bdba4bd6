"""Multi-head latent attention made sparse by an indexer (GLM-5's DeepSeek sparse
attention): each query attends over the latents of the context positions its indexer
chose (layers/indexer.py), in the absorbed form (layers/mla.py) — q_nope taken through
W_UK, attention over the chosen latents in the pool (layers/sparse.py: one kernel on a
GPU), the latent output through W_UV.

A layer without its own indexer reuses the positions the last layer with one chose (GLM-5's
"shared" layers), so the choice travels from layer to layer with the hidden state.
"""

from __future__ import annotations

import torch

from freetoken.layers import sparse
from freetoken.layers.indexer import TokenIndexer
from freetoken.layers.mla import MLAttention

__all__ = ["SparseMLAttention"]


class SparseMLAttention(MLAttention):
    """MLAttention's weights, and an indexer (None: use the positions passed in)."""

    def __init__(self, layer: int, hidden: int, n_heads: int, indexer: TokenIndexer | None, **kw):
        super().__init__(layer, hidden, n_heads, **kw)
        self.indexer = indexer

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        chosen: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The output [T, H] and the context positions [T, K] each token attended to."""
        T = x.shape[0]
        cos, sin = rope
        q, q_resid = self._query(x)
        q = q.view(T, self.n_heads, self.dn + self.dr)
        q_nope, q_pe = q[..., : self.dn], self._rope(q[..., self.dn :], cos, sin)
        _, cache = self._store_latent(x, cos, sin)
        if self.indexer is not None:
            chosen = self.indexer(x, q_resid, rope)
        elif chosen is None:
            raise ValueError(f"layer {self.layer} shares an indexer but none ran before it")
        q_abs = torch.einsum("thn,hnr->thr", q_nope, self.w_uk().to(q_nope.dtype))
        query = torch.cat((q_abs, q_pe), dim=-1)
        o = sparse.attend(query, cache, sparse.rows_of(chosen), self.scale, self.r)
        out = torch.einsum("thr,hvr->thv", o, self.w_uv().to(o.dtype))
        return self.o_proj(out.reshape(T, -1)), chosen
