"""RMSNorm, computed in fp32 and cast back, as the reference implementations do; and the
per-head q/k RMSNorm followed by rotary embedding that Qwen3's attention applies.

A zero-centred norm (Qwen3-Next's, Qwen3.5's) scales by 1 + weight, so its weights are
stored around zero; it multiplies in fp32 and rounds once, as its reference does, where
the plain norm rounds the normalised value before the weight. A weight kept in fp32 beside
activations of another dtype (DeepSeek-V4's) multiplies in fp32 and rounds once too.

On a GPU each is one Triton kernel (kernels/triton/norm.py) unless the fused kernels are off
(layers/fused.py); the torch code here is what they are tested against and what runs
everywhere else.
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken.kernels.triton import block
from freetoken.layers import fused
from freetoken.layers.rope import apply_rope


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False
) -> torch.Tensor:
    if fused.usable(x, weight) and x.shape[-1] <= 16384:
        from freetoken.kernels.triton import norm

        out = torch.empty_like(x)
        D = x.shape[-1]
        norm.rms_norm_kernel[(x.numel() // D,)](
            x, weight, out, D, eps, BLOCK=block(D), ZERO_CENTERED=zero_centered
        )
        return out
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (x32 * (1.0 + weight.float())).to(dtype)
    if weight.dtype != dtype:
        return (x32 * weight.float()).to(dtype)
    return weight * x32.to(dtype)


def head_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    zero_centered: bool = False,
) -> torch.Tensor:
    """x [T, heads, D]: each head normalised and scaled by weight [D], then rotated by
    cos/sin [T, R] (R < D: partial rotary, the first R dimensions; the kernel rotates all)."""
    T, heads, D = x.shape
    if fused.usable(x, weight, cos, sin) and D == block(D) and D >= 2 and cos.shape[-1] == D:
        from freetoken.kernels.triton import norm

        out = torch.empty_like(x)
        norm.head_norm_rope_kernel[(T * heads,)](
            x, weight, cos, sin, out, heads, eps, D=D, HALF=D // 2, ZERO_CENTERED=zero_centered
        )
        return out
    return apply_rope(rms_norm(x, weight, eps, zero_centered), cos, sin)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self.eps, self.zero_centered = eps, zero_centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centered)
