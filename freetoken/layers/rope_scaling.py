"""Rotary embeddings with context-extension scaling (linear, YaRN), and the interleaved
pair layout DeepSeek checkpoints keep their rotary dimensions in.

`RopeScaling` is what a config's rope settings say (`rope_scaling` on the Hub,
`rope_parameters` in transformers 5; models/hub.py `rope_parameters` reads either into one
dict). From it come the inverse frequencies, the factor cos/sin are scaled by (YaRN's
attention factor) and, for multi-head latent attention, the softmax scale's own YaRN
correction (`mscale_all_dim`).

YaRN (arXiv:2309.00071) blends, per frequency, the original ("extrapolated") and the
factor-divided ("interpolated") frequency: dimensions that turn more than beta_fast times
over the original context keep theirs, those turning fewer than beta_slow times are
interpolated, and a linear ramp joins the two between the dimensions where those counts
fall (rounded outwards unless `truncate` is off, as gpt-oss's config has it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from freetoken.layers.computed import ComputedBuffers
from freetoken.layers.rope import apply_rope

__all__ = ["KINDS", "RopeScaling", "ScaledRotaryEmbedding", "apply_rope_interleaved", "inv_freq"]

KINDS = ("default", "linear", "yarn")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by `factor`: 1 + 0.1·m·ln(factor)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float = 1.0
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unsupported rope scaling {self.kind!r} (one of {KINDS})")

    @classmethod
    def from_params(cls, params: Mapping[str, Any], max_position_embeddings: int) -> RopeScaling:
        """From one rope settings dict (`rope_type` or `type`, `factor`, ...)."""
        kind = params.get("rope_type") or params.get("type") or "default"
        if kind == "default":
            return cls()
        if kind == "linear":
            return cls("linear", float(params["factor"]))
        if kind != "yarn":
            raise ValueError(f"unsupported rope scaling {kind!r} (one of {KINDS})")
        original = int(params.get("original_max_position_embeddings") or max_position_embeddings)
        factor = params.get("factor")
        # without a factor the stretch is the ratio of the served and pretrained lengths
        factor = float(factor) if factor is not None else max_position_embeddings / original
        mscale = float(params.get("mscale") or 0.0)
        mscale_all = float(params.get("mscale_all_dim") or 0.0)
        attention = params.get("attention_factor")
        if attention is None:
            attention = (
                yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                if mscale and mscale_all
                else yarn_mscale(factor)
            )
        return cls(
            "yarn",
            factor,
            original,
            float(params.get("beta_fast") or 32.0),
            float(params.get("beta_slow") or 1.0),
            mscale,
            mscale_all,
            float(attention),
            bool(params.get("truncate", True)),
        )

    def softmax_scale(self, head_dim: int) -> float:
        """head_dim^-1/2, times DeepSeek's mscale(factor, mscale_all_dim)² where the
        settings name one (multi-head latent attention's softmax scale)."""
        scale = head_dim**-0.5
        if self.kind != "default" and self.mscale_all_dim:
            m = yarn_mscale(self.factor, self.mscale_all_dim)
            scale = scale * m * m
        return scale


def _correction_dim(turns: float, dim: int, theta: float, length: int) -> float:
    """The (fractional) dimension whose frequency turns `turns` times over `length`."""
    return dim * math.log(length / (turns * 2 * math.pi)) / (2 * math.log(theta))


def _yarn_ramp(s: RopeScaling, dim: int, theta: float) -> torch.Tensor:
    """Per frequency, 0 where the original frequency is kept, 1 where it is interpolated."""
    lo = _correction_dim(s.beta_fast, dim, theta, s.original_max_position_embeddings)
    hi = _correction_dim(s.beta_slow, dim, theta, s.original_max_position_embeddings)
    if s.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001  # a ramp of no width would divide by zero
    return ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)


def inv_freq(
    dim: int, theta: float, s: RopeScaling, device: torch.device | None = None
) -> tuple[torch.Tensor, float]:
    """The inverse frequencies [dim / 2] of a rotary embedding over `dim` dimensions, and
    the factor its cos/sin are scaled by."""
    powers = theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    base = 1.0 / powers
    if s.kind == "default":
        return base, 1.0
    if s.kind == "linear":
        return base / s.factor, 1.0
    keep = 1 - _yarn_ramp(s, dim, theta).to(device)
    stretched = 1.0 / (s.factor * powers)
    return stretched * (1 - keep) + base * keep, s.attention_factor


class ScaledRotaryEmbedding(ComputedBuffers):
    """cos/sin [T, dim] for arbitrary positions (rotate-half layout, or with `pairs` each
    frequency twice in a row for rotating adjacent pairs), each times the scaling's
    attention factor."""

    def __init__(
        self, dim: int, theta: float, scaling: RopeScaling | None = None, pairs: bool = False
    ):
        super().__init__()
        self.dim, self.theta, self.pairs = dim, theta, pairs
        self.scaling = scaling or RopeScaling()
        self.attention_factor = 1.0
        self.register_buffer("inv_freq", torch.empty(dim // 2), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        if self.inv_freq.is_meta:
            return
        freqs, self.attention_factor = inv_freq(
            self.dim, self.theta, self.scaling, self.inv_freq.device
        )
        with torch.no_grad():
            self.inv_freq.copy_(freqs)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, dim/2]
        if self.pairs:
            emb = freqs.repeat_interleave(2, dim=-1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): pairs to halves."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] whose rotary pairs are adjacent dimensions (DeepSeek's layout), rotated
    by cos/sin [T, D]; the result is in the rotate-half layout, which leaves every dot product
    between rotated queries and keys as it is."""
    return apply_rope(deinterleave(x), cos, sin)
