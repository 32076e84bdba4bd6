"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the residual stream is n
parallel streams [T, n, H] rather than one. Before each block a small projection of the
(normalised, flattened) streams gives three mixings:

    pre  [n]     σ(·) + eps: the weights that collapse the streams into the block's input;
    post [n]     2σ(·): how the block's output is spread back over the streams;
    comb [n, n]  softmax rows + eps, made doubly stochastic by Sinkhorn-Knopp iterations:
                 how the streams mix into themselves around the block,

    streams' = post ⊗ block(Σ_i pre_i · streams_i) + combᵀ · streams

The weights are computed in fp32, as the reference does; a last `HyperHead` collapses the
streams before the final norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["HyperConnection", "HyperHead", "unweighted_rms_norm"]


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, the rms taken in fp32, in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    """fn [(2 + n)·n, n·H], base [(2 + n)·n], scale [3] (pre, post, comb)."""

    def __init__(self, hidden: int, n: int, sinkhorn_iters: int, eps: float, norm_eps: float):
        super().__init__()
        self.n, self.iters, self.eps, self.norm_eps = n, sinkhorn_iters, eps, norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden))
        self.base = nn.Parameter(torch.empty((2 + n) * n))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, H] -> post [T, n], comb [T, n, n] (fp32) and the block's input
        [T, H]."""
        T, n = streams.shape[:2]
        flat = unweighted_rms_norm(streams.reshape(T, -1).float(), self.norm_eps)
        mix = F.linear(flat, self.fn.float())
        pre, post, comb = mix.split([n, n, n * n], dim=-1)
        b_pre, b_post, b_comb = self.base.float().split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre * s_pre + b_pre) + self.eps
        post = 2 * torch.sigmoid(post * s_post + b_post)
        comb = comb.view(T, n, n) * s_comb + b_comb.view(n, n)
        comb = torch.softmax(comb, dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre[..., None] * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def merge(
        streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """The streams after a block with output out [T, H]: post ⊗ out + combᵀ · streams."""
        dtype = streams.dtype
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
        return post.to(dtype)[..., None] * out[:, None, :] + mixed


class HyperHead(nn.Module):
    """The final collapse of the streams: σ(hc_fn · norm(streams) · hc_scale + hc_base) +
    eps weights them."""

    def __init__(self, hidden: int, n: int, eps: float, norm_eps: float):
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * hidden))
        self.hc_base = nn.Parameter(torch.empty(n))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mix = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mix * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre[..., None] * streams).sum(dim=1).to(streams.dtype)
