"""Plain-torch reference kernels: the definition every fast kernel is tested against.

Expert banks are a mapping of bank name to tensor, as `ExpertSpec.banks` names them:
gate_up [E, 2I, H] (gate rows first), down [E, H, I], and with biases gate_up_bias [E, 2I]
and down_bias [E, H]. The spec (models/base.py) says what each expert computes, and in
which block format (freetoken/quant) each matrix bank is packed, if any: a packed bank is
uint8 [E, rows, row_bytes], decoded here by `dequantize`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # kernels sit below models: the spec is read, never built, here
    from freetoken.models.base import ExpertSpec

Banks = Mapping[str, torch.Tensor]


def activate(gate: torch.Tensor, up: torch.Tensor, spec: ExpertSpec) -> torch.Tensor:
    """The expert's hidden activation from its gate and up projections."""
    if spec.activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=spec.limit)
    up = up.clamp(min=-spec.limit, max=spec.limit)
    if spec.activation == "silu_clamped":
        return F.silu(gate) * up
    return (up + 1) * gate * torch.sigmoid(gate * spec.alpha)


def expert_ffn(x: torch.Tensor, w: Banks, spec: ExpertSpec) -> torch.Tensor:
    """One expert over x [n, H]; `w` holds that expert's rows of each bank."""
    gate, up = F.linear(x, w["gate_up"], w.get("gate_up_bias")).chunk(2, dim=-1)
    return F.linear(activate(gate, up, spec), w["down"], w.get("down_bias"))


def expert_rows(w: Banks, lo: int, hi: int, down_bias: bool) -> dict[str, torch.Tensor]:
    """One expert's weights `w` (float rows, as `expert_weights` gives them) cut to its
    intermediate rows [lo, hi): the part of a miss split by its rows that one path computes.
    The parts' outputs sum to the expert's; the down bias belongs to one part only."""
    I = w["gate_up"].shape[0] // 2
    rows = torch.cat([torch.arange(lo, hi), torch.arange(I + lo, I + hi)])
    out = {"gate_up": w["gate_up"][rows], "down": w["down"][:, lo:hi]}
    if "gate_up_bias" in w:
        out["gate_up_bias"] = w["gate_up_bias"][rows]
    if down_bias and "down_bias" in w:
        out["down_bias"] = w["down_bias"]
    return out


def moe_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    banks: Banks,
    spec: ExpertSpec,
    expert: Callable[[Banks, int, ExpertSpec, torch.dtype], dict] | None = None,
) -> torch.Tensor:
    """Σ_j weights[t, j] · expert[ids[t, j]](x[t]) over `banks` indexed by `ids`; routes
    whose id is negative contribute nothing (others serve them).

    Each routed expert runs once over the tokens that chose it; accumulation is in the
    dtype of x (fp32 for fp32 models), in the order the experts are visited. `expert`
    gives an expert's weights in a dtype (default `expert_weights`; a kernel may decode).
    """
    expert = expert or expert_weights
    out = torch.zeros_like(x)
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    experts, counts = torch.unique_consecutive(flat_ids[order], return_counts=True)
    k = ids.shape[1]
    start = 0
    for e, n in zip(experts.tolist(), counts.tolist()):
        sel = order[start : start + n]
        start += n
        if e < 0:
            continue
        tok = sel // k
        y = expert_ffn(x[tok], expert(banks, e, spec, x.dtype), spec)
        out.index_add_(0, tok, y * weights.reshape(-1)[sel, None].to(x.dtype))
    return out


def expert_weights(banks: Banks, e: int, spec: ExpertSpec, dtype: torch.dtype) -> dict:
    """Expert e's rows of every bank in `dtype`, packed banks decoded.

    A packed expert's bytes start its row of the bank, which may be wider: a slot pool's
    rows fit the widest format of any layer."""
    out = {}
    for name, t in banks.items():
        fmt = spec.format_of(name)
        if fmt:
            rows, row_bytes = spec.stored_rows()[name]
            t = dequantize(t[e].reshape(-1)[: rows * row_bytes].view(rows, row_bytes), fmt)
        else:
            t = t[e]
        out[name] = t.to(dtype)
    return out


# ---- packed block formats (freetoken/quant): the definition of every format's decoding ----

# e2m1 codes 0-15 (sign bit 3): MXFP4's and NVFP4's element values
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(packed: torch.Tensor, fmt: str) -> torch.Tensor:
    """A packed tensor (uint8 [..., row_bytes]) as float32 [..., cols]."""
    from freetoken import quant

    f = quant.get(fmt)
    *outer, row_bytes = packed.shape
    blocks = packed.reshape(-1, f.block_bytes)
    return _DECODE[fmt](blocks).reshape(*outer, f.logical_cols(row_bytes))


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] little-endian bytes as fp16 values [n, 1] in fp32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, m] bytes as [n, 2m] 4-bit codes: every low nibble, then every high nibble."""
    return torch.cat([qs & 15, qs >> 4], dim=1)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (_nibbles(b[:, 2:]).float() - 8)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    values = torch.tensor(E2M1, device=b.device)[_nibbles(b[:, 1:]).long()]
    return values * torch.exp2(b[:, :1].float() - 127)


def k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins [n, 8] of a K-quant block's 12 scale bytes [n, 12]."""
    lo, hi, mix = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = torch.cat([lo & 63, (mix & 15) | ((lo >> 6) << 4)], dim=1)
    mins = torch.cat([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], dim=1)
    return scales.float(), mins.float()


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes [n, 128] as 256 codes [n, 8, 32]: per 64 weights, 32 low nibbles then 32 high."""
    q = qs.reshape(-1, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8, device=qs.device).view(
        1, 1, 2, 1
    )
    return (q & 15).reshape(-1, 8, 32)


def _k_affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    scales, mins = k_scales(b[:, 4:16])
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    return ((d * scales)[:, :, None] * q.float() - (dmin * mins)[:, :, None]).reshape(-1, 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_affine(b, _k_low_nibbles(b[:, 16:144]))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)
    high = (b[:, 16:48].reshape(-1, 1, 32) >> shifts) & 1
    return _k_affine(b, _k_low_nibbles(b[:, 48:176]) | (high << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    halves = []
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 4, 1)
    for h in range(2):
        low = _nibbles(b[:, 64 * h : 64 * h + 64])  # [n, 128]
        high = ((b[:, 128 + 32 * h : 160 + 32 * h].reshape(-1, 1, 32) >> shifts) & 3).reshape(
            -1, 128
        )
        halves.append((low | (high << 4)).float() - 32)
    q = torch.cat(halves, dim=1).reshape(-1, 16, 16)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    return ((_f16(b[:, 208:210]) * scales)[:, :, None] * q).reshape(-1, 256)


def _fp8_e4m3(b: torch.Tensor) -> torch.Tensor:
    scale = b[:, :4].contiguous().view(torch.float32)
    return b[:, 4:].contiguous().view(torch.float8_e4m3fn).float() * scale


def _nvfp4(b: torch.Tensor) -> torch.Tensor:
    # the two scales multiplied first: every kernel rounds each weight once, code · scale
    scale = b[:, 4:12].contiguous().view(torch.float8_e4m3fn).float()
    scale = scale * b[:, :4].contiguous().view(torch.float32)
    q = b[:, 12:]
    codes = torch.stack([q & 15, q >> 4], dim=-1).reshape(-1, 8, 16)  # weight 2i: byte i's low
    values = torch.tensor(E2M1, device=b.device)[codes.long()]
    return (values * scale[:, :, None]).reshape(-1, 128)


_DECODE = {
    "q8_0": _q8_0,
    "q4_0": _q4_0,
    "q4_k": _q4_k,
    "q5_k": _q5_k,
    "q6_k": _q6_k,
    "mxfp4": _mxfp4,
    "fp8_e4m3": _fp8_e4m3,
    "nvfp4": _nvfp4,
}
