"""Checkpoints' own quantized layouts, repacked losslessly into the block formats.

gpt-oss's Hugging Face MXFP4 keeps each matrix as `*_blocks` [..., G, 16] (the two codes of
byte b are weights 2b (low nibble) and 2b + 1) beside `*_scales` [..., G] (e8m0). GGUF's
MXFP4 block holds the same 32 codes and exponent in q4_0's nibble order with the exponent
first, which is the format banks keep.

FP8 checkpoints (DeepSeek-V3, Qwen3 FP8) keep e4m3 weights [R, C] beside `weight_scale_inv`
[⌈R/128⌉, ⌈C/128⌉], one fp32 multiplier per 128×128 block. The `fp8_e4m3` format gives each
row's 128-weight blocks their block's multiplier, so rows stand alone (4 bytes more per 128).

NVIDIA ModelOpt's NVFP4 keeps each linear layer's `weight` as uint8 [R, C/2] (two e2m1 codes
a byte, the even column in the low nibble), `weight_scale` e4m3 [R, C/16] and the fp32 scalar
`weight_scale_2`. The `nvfp4` format keeps the codes in that order, so each 128 weights' block
is the scalar, their 8 scales and their 64 code bytes copied (4 bytes more per 128 weights).
"""

from __future__ import annotations

import torch

from freetoken.quant import QuantError

__all__ = ["fp8_rows", "mxfp4_from_hf", "mxfp4_rows", "nvfp4_from_modelopt"]

FP8_BLOCK = 128
NVFP4_BLOCK = 128


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


def mxfp4_rows(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's FP4 experts: e2m1 codes [..., R, C/2] (float4_e2m1fn_x2 or their bytes,
    the first of each pair in the low nibble) with an e8m0 scale [..., R, C/32] for each 32
    (float8_e8m0fnu or its bytes) as packed mxfp4: the same codes and exponents as
    gpt-oss's blocks, laid out a row at a time."""
    *outer, R, half = weight.shape
    if tuple(scale.shape) != (*outer, R, 2 * half // 32) or (2 * half) % 32:
        raise QuantError(
            f"FP4 weight of {tuple(weight.shape)} bytes needs one e8m0 scale a 32 weights, "
            f"found scales {tuple(scale.shape)}"
        )
    blocks = weight.contiguous().view(torch.uint8).reshape(*outer, R, half // 16, 16)
    return mxfp4_from_hf(blocks, scale.contiguous().view(torch.uint8))


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


def nvfp4_from_modelopt(
    weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor
) -> torch.Tensor:
    """ModelOpt's uint8 codes [..., R, C/2], e4m3 scales [..., R, C/16] (or their bytes) and
    fp32 scalar `weight_scale_2` (one element) as packed nvfp4 [..., R, C/128 · 76]."""
    *outer, R, half = weight.shape
    C = 2 * half
    if weight.dtype != torch.uint8 or C % NVFP4_BLOCK:
        raise QuantError(
            f"NVFP4 weight {tuple(weight.shape)} {weight.dtype}: uint8 rows of whole "
            f"{NVFP4_BLOCK}-weight blocks expected"
        )
    if tuple(weight_scale.shape) != (*outer, R, C // 16):
        raise QuantError(
            f"NVFP4 weight {tuple(weight.shape)} needs scales {(*outer, R, C // 16)}, "
            f"found {tuple(weight_scale.shape)}"
        )
    if weight_scale.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise QuantError(f"NVFP4 scales are e4m3, not {weight_scale.dtype}")
    if weight_scale_2.numel() != 1:
        raise QuantError(f"NVFP4 weight_scale_2 is one number, not {tuple(weight_scale_2.shape)}")
    nb = C // NVFP4_BLOCK
    s2 = weight_scale_2.reshape(1).float().view(torch.uint8).expand(*outer, R, nb, 4)
    scales = weight_scale.contiguous().view(torch.uint8).reshape(*outer, R, nb, 8)
    codes = weight.contiguous().reshape(*outer, R, nb, 64)
    return torch.cat([s2, scales, codes], dim=-1).flatten(-2)
