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
