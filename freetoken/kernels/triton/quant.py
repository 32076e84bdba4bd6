"""Packed blocks decoded in registers inside Triton kernels (formats: freetoken/quant).

A kernel walks the rows of a matrix in steps of STEP weights (a K-quant super-block, eight
32-weight blocks, two FP8 blocks). `unpack` reads step kb of a tile of rows with one load per
field of the blocks: codes as a byte tile [rows, groups, 1, codes] that the compiler widens
to 16-byte loads wherever it can prove the alignment, scales as int16/int32 words. It
returns the step as codes v and per-group factors a and b,

    w[r, col[g, h, l]] = a[r, g, h] · (v[r, g, h, l] − OFFSET) + b[r, g, h]

g a group sharing one scale (a block, a K-quant sub-block), h the half of a byte (low or
high nibble; one half where a code is a whole byte), l the code's place in its group. The
codes keep the order of their bytes and `col` says which weight each is, so a dot product
reads the activations in that order instead of moving codes.

Integer codes (v < 2^BITS) come shifted to the top of an fp32 mantissa, v·2^(23 − BITS),
which a shift and a mask make straight from their bytes; `dot` ORs in the exponent of 1.0
and reads f = 1 + v/2^BITS, so no weight takes an int-to-float conversion (a quarter of the
arithmetic's rate) or a subtraction: the offsets go into each group's factors. e2m1 and
e4m3 codes are moved into fp16 bit patterns (fp16 handles their subnormals), v their value
scaled down by a power of two that a gives back. `moe_quant.dequant_kernel` writes the
formula above, rounded as kernels/reference.py rounds it.

Only integer loads, integer arithmetic and bit casts are used, no fp8 or fp16 loads:
Triton's interpreter runs the same code on the CPU. Fields are read through int16/int32
pointers, so a slot must start 4-byte aligned (moe_gpu checks the pool); each format's
blocks then keep their fields aligned.
"""

import triton
import triton.language as tl

STEP = tl.constexpr(256)  # weights per step of every format

# by format code (float weights, then q8_0, q4_0, q4_k, q5_k, q6_k, mxfp4, fp8_e4m3, nvfp4):
# the (G, H, L) of `unpack`'s terms, integer codes' width (0: the codes are floats) and offset
_SHAPES = ((1, 1, 256), (8, 1, 32), (8, 2, 16), (4, 2, 32), (4, 2, 32), (8, 2, 16), (8, 2, 16),
           (2, 1, 128), (16, 2, 8))  # fmt: skip
_BITS = (0, 8, 4, 4, 5, 6, 0, 0, 0)
_OFFSETS = (0, 128, 8, 0, 0, 32, 0, 0, 0)


@triton.constexpr_function
def has_min(fmt):
    """Whether b is other than 0: the K-quants with mins (q4_k, q5_k)."""
    return fmt == 3 or fmt == 4


@triton.constexpr_function
def _bits(fmt):
    return _BITS[fmt]


@triton.constexpr_function
def _offset(fmt):
    return _OFFSETS[fmt]


@triton.constexpr_function
def _summed(fmt):
    """Whether `dot` sums each group's codes every step: where a thread holds 16 of them
    (K-quants, 16-byte aligned). Codes read a byte or two at a time lie one or two to a
    thread, so a step's group sums would cost shuffles across threads for every group:
    those formats keep a product per code until the end instead."""
    return fmt == 3 or fmt == 4


@triton.constexpr_function
def _acc_shape(rows, fmt):
    g, h, n = _SHAPES[fmt]
    return [rows, g, h, 1 if _summed(fmt) else n]


@triton.jit
def zeros(R: tl.constexpr, FMT: tl.constexpr):
    """An accumulator of `dot`'s shape for R rows."""
    return tl.zeros(_acc_shape(R, FMT), dtype=tl.float32)


@triton.jit
def total(acc):
    """Each row's sum of a `dot` accumulator ([R])."""
    return tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)


@triton.jit
def dot(v, a, b, x, FMT: tl.constexpr):
    """A step's w·x per row, as `zeros` shapes it (the sum across a row's groups waits for
    `total`: every step it would cost a barrier). x [G, H, L] in col's order."""
    BITS: tl.constexpr = _bits(FMT)
    SUMMED: tl.constexpr = _summed(FMT)
    if BITS == 0:
        part = (v * a) * x
    else:
        # w = a·(code − OFFSET) + b = a1·f + b1, f = 1 + code/ONE (exact, v's bits under 1.0's)
        ONE: tl.constexpr = 1 << BITS
        f = (v | 0x3F800000).to(tl.float32, bitcast=True)
        a1 = a * ONE
        b1 = b - a * (ONE + _offset(FMT))
        if SUMMED:
            part = a1 * tl.sum(f * x, axis=3, keep_dims=True)
            part += b1 * tl.sum(x, axis=2, keep_dims=True)
        else:
            part = (f * a1 + b1) * x
    return part


@triton.jit
def weights(v, a, b, FMT: tl.constexpr):
    """`unpack`'s terms as fp32 weights, rounded as kernels/reference.py rounds them where
    the caller's launch leaves multiply-adds unfused."""
    BITS: tl.constexpr = _bits(FMT)
    if BITS == 0:
        w = v * a
    else:  # the code back from the top of the mantissa: an exact integer here
        w = a * ((v >> (23 - BITS)) - _offset(FMT)).to(tl.float32)
        if has_min(FMT):
            w += b
    return w


@triton.jit
def step_x(xp, kb, col, COLS: tl.constexpr):
    """The activations a step's codes meet: x[kb·STEP + col] in fp32 (0 past COLS)."""
    c = kb * STEP + col
    return tl.load(xp + c, mask=c < COLS, other=0.0).to(tl.float32)


@triton.jit
def _half(bits):
    """The fp16 number whose bits an int32 holds (0..65535), in fp32."""
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _u8(p, mask):
    return tl.load(p, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(p, mask):
    """The fp16 at byte pointers p (2-byte aligned), in fp32."""
    bits = tl.load(p.to(tl.pointer_type(tl.int16)), mask=mask, other=0)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _i32(p, mask):
    """The little-endian int32 at byte pointers p (4-byte aligned)."""
    return tl.load(p.to(tl.pointer_type(tl.int32)), mask=mask, other=0)


@triton.jit
def _e2m1(c):
    """e2m1 codes (sign in bit 3) as their values · 2^-14: the magnitude's three bits land on
    fp16's two low exponent bits and top mantissa bit, code 1 on its subnormal 2^-15."""
    return _half(((c & 7) << 9) | ((c & 8) << 12))


@triton.jit
def row_ptrs(
    base, rows, COLS: tl.constexpr, FMT: tl.constexpr, QB: tl.constexpr, QBYTES: tl.constexpr
):
    """Where each row of the matrix at `base` starts: float elements where FMT is 0, else
    bytes of packed blocks (QB weights in QBYTES bytes)."""
    if FMT == 0:
        return base + rows.to(tl.int64) * COLS
    return base + rows.to(tl.int64) * (COLS // QB * QBYTES)


@triton.jit
def unpack(rp, kb, mask, COLS: tl.constexpr, FMT: tl.constexpr, QBYTES: tl.constexpr):
    """Step kb of the rows starting at rp (`row_ptrs`; rows where `mask` is false read no
    memory) as (v, a, b, col): v [R, G, H, L] (integer codes at the top of a mantissa), a and b
    [R, G, H, 1] (b 0.0 without mins), col [G, H, L] (module docstring). Weights past COLS
    decode as 0."""
    if FMT == 0:
        v, a, b, col = _plain(rp, kb, mask, COLS)
    elif FMT == 1:
        v, a, b, col = _q8_0(rp, kb, mask, COLS // 32, QBYTES)
    elif FMT == 2:
        v, a, b, col = _q4_0(rp, kb, mask, COLS // 32, QBYTES)
    elif FMT == 3:
        v, a, b, col = _q4_k(rp, kb, mask, QBYTES)
    elif FMT == 4:
        v, a, b, col = _q5_k(rp, kb, mask, QBYTES)
    elif FMT == 5:
        v, a, b, col = _q6_k(rp, kb, mask, QBYTES)
    elif FMT == 6:
        v, a, b, col = _mxfp4(rp, kb, mask, COLS // 32, QBYTES)
    elif FMT == 7:
        v, a, b, col = _fp8_e4m3(rp, kb, mask, COLS // 128, QBYTES)
    else:
        v, a, b, col = _nvfp4(rp, kb, mask, COLS // 128, QBYTES)
    return v, a, b, col


@triton.jit
def _plain(rp, kb, mask, COLS: tl.constexpr):
    """Float weights: one group of STEP, read as they are."""
    col = tl.arange(0, STEP)[None, None, :]
    m = mask[:, None, None, None] & (kb * STEP + col < COLS)
    v = tl.load(rp[:, None, None, None] + kb * STEP + col, mask=m, other=0.0)
    return v.to(tl.float32), 1.0, 0.0, col


@triton.jit
def _blocks(rp, kb, mask, NB: tl.constexpr, NBLK: tl.constexpr, QBYTES: tl.constexpr):
    """Pointers [R, NB, 1, 1] to step kb's NB blocks of each row, and which to read (rows
    in `mask`, blocks before the row's NBLK)."""
    g = tl.arange(0, NB)[:, None, None]
    blk = kb * NB + g
    return rp[:, None, None, None] + blk * QBYTES, mask[:, None, None, None] & (blk < NBLK)


@triton.jit
def _q8_0(rp, kb, mask, NBLK: tl.constexpr, QBYTES: tl.constexpr):
    """8 blocks of d (fp16) and 32 int8 codes."""
    bp, m = _blocks(rp, kb, mask, 8, NBLK, QBYTES)
    g = tl.arange(0, 8)[:, None, None]
    l = tl.arange(0, 32)[None, None, :]
    v = (_u8(bp + 2 + l, m) << 15) ^ (128 << 15)  # the int8 code + 128
    return v, _f16(bp, m), 0.0, 32 * g + l


@triton.jit
def _q4_0(rp, kb, mask, NBLK: tl.constexpr, QBYTES: tl.constexpr):
    """8 blocks of d and 16 bytes, byte l holding weight l (low nibble) and l + 16."""
    bp, m = _blocks(rp, kb, mask, 8, NBLK, QBYTES)
    g = tl.arange(0, 8)[:, None, None]
    h = tl.arange(0, 2)[None, :, None]
    l = tl.arange(0, 16)[None, None, :]
    v = (_u8(bp + 2 + l, m) << (19 - 4 * h)) & (15 << 19)
    return v, _f16(bp, m), 0.0, 32 * g + 16 * h + l


@triton.jit
def _mxfp4(rp, kb, mask, NBLK: tl.constexpr, QBYTES: tl.constexpr):
    """8 blocks of an e8m0 exponent e and 16 bytes of e2m1 codes in q4_0's order."""
    bp, m = _blocks(rp, kb, mask, 8, NBLK, QBYTES)
    g = tl.arange(0, 8)[:, None, None]
    h = tl.arange(0, 2)[None, :, None]
    l = tl.arange(0, 16)[None, None, :]
    v = _e2m1((_u8(bp + 1 + l, m) >> 4 * h) & 15)
    # 2^(e − 127) · 2^14 built as fp32 bits; exponents past 240 (no weights have them)
    # saturate to infinity instead of wrapping into the sign bit
    a = ((tl.minimum(_u8(bp, m), 241) + 14) << 23).to(tl.float32, bitcast=True)
    return v, a, 0.0, 32 * g + 16 * h + l


@triton.jit
def _fp8_e4m3(rp, kb, mask, NBLK: tl.constexpr, QBYTES: tl.constexpr):
    """2 blocks of an fp32 scale and 128 e4m3 codes; e4m3's exponent and mantissa bits
    shifted into fp16's read as the value · 2^-8 (subnormals included)."""
    bp, m = _blocks(rp, kb, mask, 2, NBLK, QBYTES)
    g = tl.arange(0, 2)[:, None, None]
    l = tl.arange(0, 128)[None, None, :]
    v = _u8(bp + 4 + l, m)
    a = _i32(bp, m).to(tl.float32, bitcast=True) * 256.0
    return _half(((v & 0x7F) << 7) | ((v & 0x80) << 8)), a, 0.0, 128 * g + l


@triton.jit
def _nvfp4(rp, kb, mask, NBLK: tl.constexpr, QBYTES: tl.constexpr):
    """2 blocks of an fp32 tensor scale s2, 8 e4m3 scales (one per 16 weights) and 64 bytes of
    e2m1 codes; group g holds weights 16g + 2l + h, the code in nibble h of its byte l. The
    e4m3 scale read as fp16 (its value · 2^-8) times s2 rounds as the reference's scale · s2,
    and 2^22 gives back that and `_e2m1`'s powers of two."""
    g = tl.arange(0, 16)[:, None, None]
    h = tl.arange(0, 2)[None, :, None]
    l = tl.arange(0, 8)[None, None, :]
    blk = kb * 2 + g // 8
    bp = rp[:, None, None, None] + blk * QBYTES
    m = mask[:, None, None, None] & (blk < NBLK)
    s2 = _i32(bp, m).to(tl.float32, bitcast=True)
    sc = _u8(bp + 4 + g % 8, m)
    a = _half(((sc & 0x7F) << 7) | ((sc & 0x80) << 8)) * s2 * 4194304.0
    v = _e2m1((_u8(bp + 12 + 8 * (g % 8) + l, m) >> 4 * h) & 15)
    return v, a, 0.0, 16 * g + 2 * l + h


@triton.jit
def _k_factors(bp, mask, s):
    """a = d·scale[s] and b = −dmin·min[s] ([R, *s.shape]) of the K-quant super-blocks at bp:
    fp16 d and dmin, then 12 bytes of 6-bit scales and mins (docs/ftw.md), read as 4 words."""
    w0 = _i32(bp, mask)[:, None, None, None]
    w1 = _i32(bp + 4, mask)[:, None, None, None]  # scales 0-3, their top bits those of 4-7
    w2 = _i32(bp + 8, mask)[:, None, None, None]  # mins 0-3, likewise
    w3 = _i32(bp + 12, mask)[:, None, None, None]  # low 4 bits of scales 4-7 | mins 4-7
    # value s is 4 low bits and 2 top bits at these shifts (s < 4: the bits of one byte)
    lo = s < 4
    sh = 8 * (s % 4)
    top = sh + tl.where(lo, 4, 6)
    sc = ((tl.where(lo, w1, w3) >> sh) & 15) | (((w1 >> top) & 3) << 4)
    mn = ((tl.where(lo, w2, w3) >> (sh + tl.where(lo, 0, 4))) & 15) | (((w2 >> top) & 3) << 4)
    a = _half(w0 & 0xFFFF) * sc.to(tl.float32)
    return a, -(_half((w0 >> 16) & 0xFFFF) * mn.to(tl.float32))


@triton.jit
def _q4_k(rp, kb, mask, QBYTES: tl.constexpr):
    """A super-block: sub-block s = 2c + h holds weights 64c + 32h + l, coded in the low
    (h = 0) or high nibble of byte 16 + 32c + l."""
    c = tl.arange(0, 4)[:, None, None]
    h = tl.arange(0, 2)[None, :, None]
    l = tl.arange(0, 32)[None, None, :]
    bp = rp + kb * QBYTES
    v = _u8(bp[:, None, None, None] + 16 + 32 * c + l, mask[:, None, None, None])
    a, b = _k_factors(bp, mask, 2 * c + h)
    return (v << (19 - 4 * h)) & (15 << 19), a, b, 64 * c + 32 * h + l


@triton.jit
def _q5_k(rp, kb, mask, QBYTES: tl.constexpr):
    """q4_k's order with the nibbles 32 bytes later, and each weight's fifth bit at bit s of
    byte 16 + l (s its sub-block)."""
    c = tl.arange(0, 4)[:, None, None]
    h = tl.arange(0, 2)[None, :, None]
    l = tl.arange(0, 32)[None, None, :]
    s = 2 * c + h
    bp = rp + kb * QBYTES
    bp4, m = bp[:, None, None, None], mask[:, None, None, None]
    v = _u8(bp4 + 48 + 32 * c + l, m)
    fifth = (_u8(bp4 + 16 + l, m) << (22 - s)) & (1 << 22)
    a, b = _k_factors(bp, mask, s)
    return ((v << (18 - 4 * h)) & (15 << 18)) | fifth, a, b, 64 * c + 32 * h + l


@triton.jit
def _q6_k(rp, kb, mask, QBYTES: tl.constexpr):
    """A super-block: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, fp16 d.
    Run u = 4p + 2i + j of 16 low-nibble bytes (p the half of the super-block) holds in its
    low (h = 0) and high nibbles the weights 16·g + n, g = 8p + 4h + 2i + j, whose top two
    bits sit at bit 2(i + 2h) of byte 128 + 32p + 16j + n; group g has scale g."""
    u = tl.arange(0, 8)[:, None, None]
    h = tl.arange(0, 2)[None, :, None]
    n = tl.arange(0, 16)[None, None, :]
    p, i, j = u // 4, (u // 2) % 2, u % 2
    bp = rp + kb * QBYTES
    bp4, m = bp[:, None, None, None], mask[:, None, None, None]
    low = (_u8(bp4 + 16 * u + n, m) << (17 - 4 * h)) & (15 << 17)
    high = (_u8(bp4 + 128 + 32 * p + 16 * j + n, m) << (21 - 2 * i - 4 * h)) & (3 << 21)
    g = 8 * p + 4 * h + 2 * i + j
    scale = tl.load(bp4 + 192 + g, mask=m, other=0).to(tl.int8).to(tl.float32)
    a = _f16(bp + 208, mask)[:, None, None, None] * scale
    return low | high, a, 0.0, 16 * g + n
