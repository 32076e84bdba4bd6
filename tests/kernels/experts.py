"""Random expert banks for every kind of expert the kernels implement (ExpertSpec variants)."""

from __future__ import annotations

import torch

from freetoken.models.base import ExpertSpec

# what the families' experts compute: SwiGLU, SwiGLU with biases, gpt-oss's clamped form and
# SwiGLU of clamped inputs (DeepSeek-V4's)
VARIANTS = {
    "swiglu": dict(),
    "swiglu+bias": dict(bias=True),
    "clamped+bias": dict(activation="swiglu_clamped", alpha=1.702, limit=7.0, bias=True),
    "silu-clamped": dict(activation="silu_clamped", limit=7.0),
}


def spec(variant: str, H: int, I: int) -> ExpertSpec:
    return ExpertSpec(H, I, **VARIANTS[variant])


def banks(
    E: int,
    s: ExpertSpec,
    dtype: torch.dtype,
    g: torch.Generator,
    device: str = "cpu",
    scale: bool = False,
) -> dict[str, torch.Tensor]:
    """[E, ...] banks of `s`; `scale` divides matrices by sqrt(fan-in) (bf16 stays in range).
    Biases are large enough that a missing or misplaced one shows; the clamp is reached."""
    out = {}
    for name, rows in s.rows().items():
        t = torch.randn((E, *rows), generator=g, device=device)
        if scale and len(rows) == 2:
            t = t / rows[1] ** 0.5
        out[name] = t.to(dtype)
    return out


# the smallest rows each format packs (K-quants 256 weights, FP8 128, the others 32)
ROW_MULTIPLE = {
    "q8_0": 32,
    "q4_0": 32,
    "mxfp4": 32,
    "fp8_e4m3": 128,
    "nvfp4": 128,
    "q4_k": 256,
    "q5_k": 256,
    "q6_k": 256,
}


def pack(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """Float weights [..., cols] in a block format: FreeToken's quantizers where it has one,
    gguf's for Q4_0 and MXFP4, FP8 with a random multiplier per 128×128 block."""
    from freetoken.quant import pack as packing
    from freetoken.quant.quantize import quantize

    if fmt in ("q8_0", "q4_k", "q5_k", "q6_k", "nvfp4"):
        return quantize(w, fmt)
    if fmt == "fp8_e4m3":
        from tests.fixtures_quant import fp8_blocks

        flat = w.reshape(-1, w.shape[-1])
        q, scale = fp8_blocks(flat)
        return packing.fp8_rows(q, scale).reshape(*w.shape[:-1], -1)
    import gguf

    q = gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType[fmt.upper()])
    return torch.from_numpy(q)


def packed_banks(
    E: int, s: ExpertSpec, g: torch.Generator, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """[E, ...] banks of `s` with its matrices packed in `s.formats` (biases in `dtype`)."""
    out = banks(E, s, torch.float32, g, scale=True)
    for name, t in out.items():
        fmt = s.format_of(name)
        out[name] = pack(t, fmt) if fmt else t.to(dtype)
    return out


def random_nvfp4(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random nvfp4 blocks for logical `shape` whose group scales run through every e4m3 code
    but NaN (subnormals included), with both signs, and every e2m1 code: what a quantizer's
    narrow range of scales would leave untested."""
    from freetoken import quant

    packed = torch.randint(0, 256, quant.get("nvfp4").packed_shape(shape), generator=g)
    packed = packed.to(torch.uint8)
    blocks = packed.view(-1, 76)
    s2 = torch.rand(blocks.shape[0], 1, generator=g) * 1e-3 + 1e-4
    blocks[:, :4] = s2.view(torch.uint8)
    scales = torch.arange(blocks.shape[0] * 8) % 127  # magnitudes 0..126: 127 is NaN
    sign = torch.randint(0, 2, scales.shape, generator=g) << 7
    blocks[:, 4:12] = (scales | sign).to(torch.uint8).view(-1, 8)
    return packed
