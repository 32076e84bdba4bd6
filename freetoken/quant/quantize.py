"""Quantizing float weights into the block formats `create --quantize` writes.

    quantize(t, "q4_k") -> uint8 [..., row_bytes]      (t float [..., cols])

Q8_0 rounds each block to its absolute maximum / 127. The K-quants fit each sub-block's
scale and offset by least squares over a few rounds (start from its range, quantize, refit
the scale and offset to the codes, quantize again), then store the sub-block scales as
6-bit (Q4_K, Q5_K) or 8-bit (Q6_K) multiples of the block's fp16 scale, and round the weights
once more against the scales as stored, so that the codes fit what decoding will compute.
NVFP4 follows NVIDIA's recipe: one tensor scale s2 = amax / (6·448) over the whole tensor
given (so the largest group scale is e4m3's largest), each 16 weights' scale the e4m3 nearest
amax16 / (6·s2), and each code the e2m1 value nearest w / (scale·s2).

`expert_format` says which format each expert bank gets under a `--quantize` type.
"""

from __future__ import annotations

import torch

from freetoken import quant

__all__ = ["expert_format", "quantize"]

_REFITS = 3


def quantize(t: torch.Tensor, fmt: str) -> torch.Tensor:
    f = quant.get(fmt)
    if fmt not in _ENCODE:
        raise quant.QuantError(f"no quantizer for {fmt}")
    *outer, cols = t.shape
    f.row_bytes(cols)  # whole blocks, or a clear error
    blocks = t.detach().float().reshape(-1, f.block)
    return _ENCODE[fmt](blocks).reshape(*outer, f.row_bytes(cols))


def expert_format(qtype: str, bank: str, layer: int, num_layers: int, cols: int) -> str | None:
    """The format of one expert bank under `create --quantize qtype` (None: left as it is).

    q8_0: every bank Q8_0. q4_K_M as llama.cpp lays it out: gate/up Q4_K, and down Q6_K in
    the layers that matter most (the first and last eighth, and every third between) and
    Q4_K elsewhere. A bank whose rows are not whole 256-weight blocks falls back to Q8_0,
    and one whose rows are not whole 32-weight blocks stays unquantized.
    """
    if qtype == "q8_0":
        want = "q8_0"
    elif qtype == "q4_K_M":
        want = "q6_k" if bank == "down" and _more_bits(layer, num_layers) else "q4_k"
    else:
        raise quant.QuantError(f"unknown quantization {qtype!r} (one of {quant.QUANTIZE_TYPES})")
    for fmt in (want, "q8_0"):
        if cols % quant.get(fmt).block == 0:
            return fmt
    return None


def _more_bits(layer: int, n: int) -> bool:
    return layer < n // 8 or layer >= 7 * n // 8 or (layer - n // 8) % 3 == 2


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """[n] values as [n, 2] bytes of fp16."""
    return v.reshape(-1, 1).to(torch.float16).view(torch.uint8)


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    d = x.abs().amax(dim=1, keepdim=True) / 127
    q = torch.where(d > 0, x / d, 0).round().clamp(-127, 127).to(torch.int8)
    return torch.cat([_f16_bytes(d), q.view(torch.uint8)], dim=1)


def _fit_affine(x: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sub-block (rows of x [n, s, m]): scale ≥ 0 and offset ≥ 0 with x ≈ scale·q − offset
    for codes q in [0, top]."""
    mn = x.amin(dim=2).clamp(max=0)
    scale = (x.amax(dim=2) - mn) / top
    offset = -mn
    for _ in range(_REFITS):
        q = _codes(x, scale, offset, top)
        qm, xm = q.mean(dim=2), x.mean(dim=2)
        var = (q * q).mean(dim=2) - qm * qm
        fit = ((q * x).mean(dim=2) - qm * xm) / var.clamp(min=1e-12)
        fit_off = fit * qm - xm
        good = (var > 1e-12) & (fit > 0) & (fit_off >= 0)
        scale = torch.where(good, fit, scale)
        offset = torch.where(good, fit_off, offset)
    return scale, offset


def _codes(x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, top: int) -> torch.Tensor:
    q = torch.where(scale[..., None] > 0, (x + offset[..., None]) / scale[..., None], 0)
    return q.round().clamp(0, top)


def _super_scale(v: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's fp16 scale d and the sub-block multiples of it (in [0, top]) for v [n, s]."""
    d = (v.amax(dim=1) / top).to(torch.float16).float()
    mult = torch.where(d[:, None] > 0, v / d[:, None], 0).round().clamp(0, top)
    return d, mult


def _k_affine(x: torch.Tensor, top: int):
    """The parts of a Q4_K/Q5_K block: d, dmin, 6-bit scales and mins [n, 8], codes [n, 8, 32]."""
    sub = x.reshape(-1, 8, 32)
    scale, offset = _fit_affine(sub, top)
    d, sc = _super_scale(scale, 63)
    dmin, mins = _super_scale(offset, 63)
    q = _codes(sub, d[:, None] * sc, dmin[:, None] * mins, top)
    return d, dmin, sc.to(torch.uint8), mins.to(torch.uint8), q.to(torch.uint8)


def _k_scale_bytes(sc: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    lo = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    hi = (mins[:, :4] & 63) | ((mins[:, 4:] >> 4) << 6)
    mix = (sc[:, 4:] & 15) | ((mins[:, 4:] & 15) << 4)
    return torch.cat([lo, hi, mix], dim=1)


def _k_low_nibble_bytes(q: torch.Tensor) -> torch.Tensor:
    """Codes [n, 8, 32] as 128 bytes: per 64 weights, the first 32 in low nibbles."""
    pairs = (q & 15).reshape(-1, 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)


def _q4_k(x: torch.Tensor) -> torch.Tensor:
    d, dmin, sc, mins, q = _k_affine(x, 15)
    parts = [_f16_bytes(d), _f16_bytes(dmin), _k_scale_bytes(sc, mins), _k_low_nibble_bytes(q)]
    return torch.cat(parts, dim=1)


def _q5_k(x: torch.Tensor) -> torch.Tensor:
    d, dmin, sc, mins, q = _k_affine(x, 31)
    bits = (q >> 4).to(torch.int32) << torch.arange(8, dtype=torch.int32).view(1, 8, 1)
    qh = bits.sum(dim=1).to(torch.uint8)  # [n, 32]: bit s of byte l from sub-block s
    parts = [_f16_bytes(d), _f16_bytes(dmin), _k_scale_bytes(sc, mins), qh]
    return torch.cat([*parts, _k_low_nibble_bytes(q)], dim=1)


def _q6_k(x: torch.Tensor) -> torch.Tensor:
    sub = x.reshape(-1, 16, 16)
    scale = sub.abs().amax(dim=2) / 31
    d = (scale.amax(dim=1) / 127).to(torch.float16).float()
    sc = torch.where(d[:, None] > 0, scale / d[:, None], 0).round().clamp(0, 127)
    eff = (d[:, None] * sc)[..., None]
    q = torch.where(eff > 0, sub / eff, 0).round().clamp(-32, 31) + 32
    q = q.to(torch.uint8).reshape(-1, 2, 128)
    ql, qh = [], []
    for h in range(2):
        half = q[:, h]
        ql.append((half[:, :64] & 15) | ((half[:, 64:] & 15) << 4))
        top = (half >> 4).reshape(-1, 4, 32).to(torch.int32)
        qh.append((top << torch.tensor([0, 2, 4, 6]).view(1, 4, 1)).sum(dim=1).to(torch.uint8))
    scales = sc.to(torch.int8).view(torch.uint8)
    return torch.cat([*ql, *qh, scales, _f16_bytes(d)], dim=1)


# e2m1 magnitudes, codes 0-7 (code | 8 is the negative)
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_E4M3_MAX = 448.0


def _nvfp4(x: torch.Tensor) -> torch.Tensor:
    """All of a tensor's blocks [n, 128]: the tensor scale is theirs together."""
    amax = x.abs().amax() if x.numel() else torch.tensor(0.0)
    s2 = (amax / (6 * _E4M3_MAX)).float().reshape(1)
    s2 = torch.where(s2 > 0, s2, torch.ones_like(s2))  # all zeros: any scale decodes them
    sub = x.reshape(-1, 8, 16)
    sc = (sub.abs().amax(dim=2) / (6 * s2)).clamp(max=_E4M3_MAX).to(torch.float8_e4m3fn)
    step = (sc.float() * s2)[..., None]  # as decoding computes it
    y = torch.where(step > 0, sub / step, 0).clamp(-6, 6)
    mag = (y.abs()[..., None] - _E2M1).abs().argmin(dim=-1)  # nearest magnitude
    codes = (mag | torch.where(y < 0, 8, 0)).to(torch.uint8).reshape(-1, 64, 2)
    qs = codes[..., 0] | (codes[..., 1] << 4)  # weight 2i in byte i's low nibble
    s2_bytes = s2.view(torch.uint8).expand(x.shape[0], 4)
    return torch.cat([s2_bytes, sc.view(torch.uint8), qs], dim=1)


_ENCODE = {"q8_0": _q8_0, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k, "nvfp4": _nvfp4}
