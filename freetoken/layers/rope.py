"""Rotary position embeddings.

The rotate-half convention of Llama/Qwen checkpoints pairs dimension i with i + R/2 of the
R rotated ones; `pairs` rotates adjacent dimensions (2i, 2i + 1) instead, which is how q and
k come out of projections whose rows llama.cpp's converter permuted for GGML's rope (the
attention scores are the same). Partial rotary (GLM-4.5, MiniMax-M2) rotates only the first
R dimensions of each head and passes the rest through: the tables are then R wide.
"""

from __future__ import annotations

import torch

from freetoken.layers.computed import ComputedBuffers


class RotaryEmbedding(ComputedBuffers):
    """cos/sin [T, dim] for arbitrary positions; tokens of a step may belong to different
    sequences. `dim` is the rotated width: the head dim, or less for partial rotary."""

    def __init__(self, head_dim: int, theta: float, *, pairs: bool = False):
        super().__init__()
        self.head_dim, self.theta, self.pairs = head_dim, theta, pairs
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        if self.inv_freq.is_meta:
            return
        d = self.head_dim
        with torch.no_grad():
            self.inv_freq.copy_(
                1.0
                / (
                    self.theta
                    ** (torch.arange(0, d, 2, dtype=torch.float32, device=self.inv_freq.device) / d)
                )
            )

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        if self.pairs:
            emb = freqs.repeat_interleave(2, dim=-1)  # [T, D]: f0 f0 f1 f1 ...
        else:
            emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]: f0 f1 ... f0 f1 ...
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: bool = False
) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, R], R <= D: the first R dimensions rotate."""
    R = cos.shape[-1]
    if R < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :R], cos, sin, pairs), x[..., R:]), dim=-1)
    rotated = _rotate_pairs(x) if pairs else _rotate_half(x)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
