"""RMSNorm, and per-head q/k RMSNorm with rotary embedding, one program per row.

At bs=1 a decode step is bound by how many kernels it runs, not by their work: the
reference RMSNorm is eight small kernels, and a head norm plus rotary embedding over q and
k 26, per layer. Each of these is one kernel, rounding where the reference
rounds (to the activations' dtype after normalising, after the weight, and after each
product and the sum of the rotation), so they agree with it to the last bit but for the
order of the sum of squares.
"""

import triton
import triton.language as tl


@triton.jit
def _scale(y, w, dt: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """The normalised y (fp32) times its weight: w rounding y first, or (1 + w) in fp32."""
    if ZERO_CENTERED:
        return y * (1.0 + w)
    return w * y.to(dt).to(tl.float32)


@triton.jit
def rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, D, eps, BLOCK: tl.constexpr, ZERO_CENTERED: tl.constexpr = False
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < D
    x = tl.load(x_ptr + row * D + offs, mask=m, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    dt = out_ptr.dtype.element_ty
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + offs, _scale(x * r, w, dt, ZERO_CENTERED).to(dt), mask=m)


@triton.jit
def head_norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, heads, eps,
    D: tl.constexpr, HALF: tl.constexpr, ZERO_CENTERED: tl.constexpr = False,
):  # fmt: skip
    """x [T, heads, D] -> out: each head RMS-normalised, scaled by w, then rotated by
    cos/sin [T, D] (rotate-half convention)."""
    row = tl.program_id(0).to(tl.int64)
    t = row // heads
    offs = tl.arange(0, D)
    partner = tl.where(offs < HALF, offs + HALF, offs - HALF)
    x = tl.load(x_ptr + row * D + offs).to(tl.float32)
    xp = tl.load(x_ptr + row * D + partner).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    dt = out_ptr.dtype.element_ty
    y = _scale(x * r, tl.load(w_ptr + offs).to(tl.float32), dt, ZERO_CENTERED)
    y = y.to(dt).to(tl.float32)
    yp = _scale(xp * r, tl.load(w_ptr + partner).to(tl.float32), dt, ZERO_CENTERED)
    yp = yp.to(dt).to(tl.float32)
    rot = tl.where(offs < HALF, -yp, yp)
    a = (y * tl.load(cos_ptr + t * D + offs).to(tl.float32)).to(dt).to(tl.float32)
    b = (rot * tl.load(sin_ptr + t * D + offs).to(tl.float32)).to(dt).to(tl.float32)
    tl.store(out_ptr + row * D + offs, (a + b).to(dt))
