"""Packed weights decoded on the fly inside Triton kernels (formats: freetoken/quant).

`weights(base, rows, cols, ...)` is a tile of a matrix whose rows are packed blocks: every
weight is decoded where it is loaded, from the bytes of its block (scales are loaded per
weight too; they sit in the same cache lines as the block's codes). FMT is the format's code
(QuantFormat.code); 0 reads plain float weights. The decoding follows docs/ftw.md, as
kernels/reference.py does in torch.

Only integer arithmetic, bit casts and exp2 are used, no fp8 or fp16 loads: Triton's
interpreter runs the same code on the CPU.
"""

import triton
import triton.language as tl


@triton.jit
def _u8(p):
    return tl.load(p).to(tl.int32)


@triton.jit
def _f16(p):
    """The fp16 value of the two bytes at p (little-endian), as fp32."""
    bits = (_u8(p) | (_u8(p + 1) << 8)).to(tl.uint16)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f32(p):
    bits = _u8(p) | (_u8(p + 1) << 8) | (_u8(p + 2) << 16) | (_u8(p + 3) << 24)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1(code):
    """MXFP4's element value of a 4-bit code (sign in bit 3)."""
    mag = code & 7
    ex = mag >> 1
    frac = (mag & 1).to(tl.float32) * 0.5
    v = tl.where(ex == 0, frac, (1.0 + frac) * tl.exp2((ex - 1).to(tl.float32)))
    return tl.where(code >= 8, -v, v)


@triton.jit
def _e4m3(b):
    ex = (b >> 3) & 15
    man = (b & 7).to(tl.float32)
    v = tl.where(ex == 0, man * 0.001953125, (1.0 + man * 0.125) * tl.exp2((ex - 7).to(tl.float32)))
    return tl.where(b >= 128, -v, v)


@triton.jit
def _k_scale(q, s):
    """The 6-bit scale and min of sub-block s from a K-quant block's 12 scale bytes at q."""
    a = _u8(q + s + 4)
    b = _u8(q + s)
    c = _u8(q + tl.where(s >= 4, s - 4, s))
    sc = tl.where(s < 4, b & 63, (a & 15) | ((c >> 6) << 4))
    m = tl.where(s < 4, a & 63, (a >> 4) | ((b >> 6) << 4))
    return sc.to(tl.float32), m.to(tl.float32)


@triton.jit
def _packed(blk, j, FMT: tl.constexpr):
    """The weights at index j of the blocks starting at byte pointers blk."""
    if FMT == 1:  # q8_0
        w = _f16(blk) * _u8(blk + 2 + j).to(tl.int8).to(tl.float32)
    elif FMT == 2:  # q4_0
        nib = (_u8(blk + 2 + (j % 16)) >> (4 * (j // 16))) & 15
        w = _f16(blk) * (nib - 8).to(tl.float32)
    elif FMT == 3:  # q4_k
        sc, m = _k_scale(blk + 4, j // 32)
        q = (_u8(blk + 16 + 32 * (j // 64) + (j % 32)) >> (4 * ((j % 64) // 32))) & 15
        w = _f16(blk) * sc * q.to(tl.float32) - _f16(blk + 2) * m
    elif FMT == 4:  # q5_k: q4_k's nibbles 32 bytes later, and a fifth bit from qh
        s = j // 32
        sc, m = _k_scale(blk + 4, s)
        q = (_u8(blk + 48 + 32 * (j // 64) + (j % 32)) >> (4 * ((j % 64) // 32))) & 15
        q = q | (((_u8(blk + 16 + (j % 32)) >> s) & 1) << 4)
        w = _f16(blk) * sc * q.to(tl.float32) - _f16(blk + 2) * m
    elif FMT == 5:  # q6_k
        h, i = j // 128, j % 128
        low = (_u8(blk + 64 * h + (i % 64)) >> (4 * (i // 64))) & 15
        high = (_u8(blk + 128 + 32 * h + (i % 32)) >> (2 * (i // 32))) & 3
        sc = _u8(blk + 192 + j // 16).to(tl.int8).to(tl.float32)
        w = _f16(blk + 208) * sc * ((low | (high << 4)) - 32).to(tl.float32)
    elif FMT == 6:  # mxfp4
        code = (_u8(blk + 1 + (j % 16)) >> (4 * (j // 16))) & 15
        w = _e2m1(code) * tl.exp2((_u8(blk) - 127).to(tl.float32))
    else:  # fp8_e4m3
        w = _e4m3(_u8(blk + 4 + j)) * _f32(blk)
    return w


@triton.jit
def weights(
    base,
    rows,
    cols,
    mask,
    COLS: tl.constexpr,
    FMT: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
):
    """fp32 [len(rows), len(cols)] tile of the matrix at `base` (rows of COLS weights): plain
    float where FMT is 0, else rows of packed blocks (BLOCK weights in BLOCK_BYTES bytes).
    Masked-out entries read as 0 and touch no memory."""
    if FMT == 0:
        w = tl.load(base + rows[:, None] * COLS + cols[None, :], mask=mask, other=0.0)
        return w.to(tl.float32)
    r = tl.where(mask, rows[:, None], 0).to(tl.int64)
    c = tl.where(mask, cols[None, :], 0)
    blk = base + r * (COLS // BLOCK * BLOCK_BYTES) + (c // BLOCK) * BLOCK_BYTES
    return tl.where(mask, _packed(blk, c % BLOCK, FMT), 0.0)
