"""Rotary position embeddings (the rotate-half convention of Llama/Qwen checkpoints)."""

from __future__ import annotations

import torch

from freetoken.layers.computed import ComputedBuffers


class RotaryEmbedding(ComputedBuffers):
    """cos/sin for arbitrary positions; tokens of a step may belong to different sequences."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
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
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, D]."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]
