"""Checkpoints' own quantized layouts, repacked losslessly into the block formats.

gpt-oss's Hugging Face MXFP4 keeps each matrix as `*_blocks` [..., G, 16] (the two codes of
byte b are weights 2b (low nibble) and 2b + 1) beside `*_scales` [..., G] (e8m0). GGUF's
MXFP4 block holds the same 32 codes and exponent in q4_0's nibble order with the exponent
first, which is the format banks keep.

FP8 checkpoints (DeepSeek-V3, Qwen3 FP8) keep e4m3 weights [R, C] beside `weight_scale_inv`
[⌈R/128⌉, ⌈C/128⌉], one fp32 multiplier per 128×128 block. The `fp8_e4m3` format gives each
row's 128-weight blocks their block's multiplier, so rows stand alone (4 bytes more per 128).
"""

from __future__ import annotations

import torch

from freetoken.quant import QuantError

__all__ = ["fp8_rows", "mxfp4_from_hf"]

FP8_BLOCK = 128


def mxfp4_from_hf(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [..., G, 16] and scales uint8 [..., G] as packed mxfp4 [..., G·17]."""
    if blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise QuantError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} disagree"
        )
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2)  # [..., G, 32] in order
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    out = torch.cat([scales.to(torch.uint8).unsqueeze(-1), packed], dim=-1)
    return out.flatten(-2)


def fp8_rows(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """e4m3 weight [..., R, C] with its block multipliers [..., ⌈R/128⌉, ⌈C/128⌉] as packed
    fp8_e4m3 [..., R, C/128 · 132]."""
    *outer, R, C = weight.shape
    want = (*outer, -(-R // FP8_BLOCK), -(-C // FP8_BLOCK))
    if C % FP8_BLOCK:
        raise QuantError(f"FP8 rows of {C} weights are not whole {FP8_BLOCK}-weight blocks")
    if tuple(scale_inv.shape) != want:
        raise QuantError(
            f"FP8 weight {tuple(weight.shape)} needs block scales {want}, "
            f"found {tuple(scale_inv.shape)}"
        )
    per_row = scale_inv.float().repeat_interleave(FP8_BLOCK, dim=-2)[..., :R, :]
    scale_bytes = per_row.contiguous().view(torch.uint8).reshape(*outer, R, C // FP8_BLOCK, 4)
    w = weight.contiguous().view(torch.uint8).reshape(*outer, R, C // FP8_BLOCK, FP8_BLOCK)
    return torch.cat([scale_bytes, w], dim=-1).flatten(-2)
