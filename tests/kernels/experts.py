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
    "q4_k": 256,
    "q5_k": 256,
    "q6_k": 256,
}


def pack(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """Float weights [..., cols] in a block format: FreeToken's quantizers where it has one,
    gguf's for Q4_0 and MXFP4, FP8 with a random multiplier per 128×128 block."""
    from freetoken.quant import pack as packing
    from freetoken.quant.quantize import quantize

    if fmt in ("q8_0", "q4_k", "q5_k", "q6_k"):
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
