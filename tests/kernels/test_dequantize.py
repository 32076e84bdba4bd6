"""The plain-torch decoding of every block format (kernels/reference.py, `dequantize`) against
the gguf package's own dequantizer on random blocks, and FP8 and NVFP4 against a direct
computation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken import quant
from freetoken.kernels import reference

GGUF_FORMATS = [f.name for f in quant.FORMATS.values() if f.ggml_type is not None]


# where each format keeps its fp16 scales
F16_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


def random_blocks(fmt: str, n: int, seed: int) -> np.ndarray:
    """n random blocks of `fmt` whose scale fields hold finite values (random bytes there
    would make NaNs and infinities that no checkpoint holds)."""
    f = quant.get(fmt)
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (n, f.block_bytes), dtype=np.uint8)
    for at in F16_FIELDS.get(fmt, ()):
        d = rng.uniform(-0.5, 0.5, n).astype(np.float16)
        b[:, at : at + 2] = d.view(np.uint8).reshape(n, 2)
    if fmt == "mxfp4":
        b[:, 0] = rng.integers(110, 140, n)
    return b


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
def test_dequantize_matches_gguf(fmt):
    import gguf

    f = quant.get(fmt)
    rows, per_row = 6, 3
    raw = random_blocks(fmt, rows * per_row, seed=f.code).reshape(rows, per_row * f.block_bytes)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(f.ggml_type))
    out = reference.dequantize(torch.from_numpy(raw), fmt)
    assert out.shape == (rows, per_row * f.block) and out.dtype == torch.float32
    torch.testing.assert_close(out, torch.from_numpy(np.asarray(ref)), rtol=1e-6, atol=0)


def test_fp8_blocks_decode_to_value_times_scale():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(4, 256, generator=g) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(4, 2, generator=g) + 0.01
    blocks = torch.cat(
        [scale.reshape(8, 1).view(torch.uint8).reshape(8, 4), w.reshape(8, 128).view(torch.uint8)],
        dim=1,
    ).reshape(4, 264)
    expect = w.float() * scale.repeat_interleave(128, dim=1)
    assert torch.equal(reference.dequantize(blocks, "fp8_e4m3"), expect)


def test_nvfp4_block_bytes_by_hand():
    """One block written out byte by byte (docs/ftw.md): fp32 s2, 8 e4m3 group scales, then
    per 16 weights 8 bytes with weight 2i in byte i's low nibble."""
    s2 = torch.tensor([0.5]).view(torch.uint8)
    # e4m3 1.0, 2.0, 2^-9 (the least subnormal), −1.0, 1.75, 448, 0, 0.0625 (2^-4)
    scales = torch.tensor([0x38, 0x40, 0x01, 0xB8, 0x3E, 0x7E, 0x00, 0x18], dtype=torch.uint8)
    codes = torch.zeros(64, dtype=torch.uint8)
    codes[0] = 0x71  # weight 0: code 1 (0.5), weight 1: code 7 (6.0)
    codes[8] = 0x0C  # weight 16: code 12 (−2.0)
    codes[3 * 8 + 7] = 0xA0  # weight 63: code 10 (−1.0)
    codes[7 * 8 + 4] = 0x05  # weight 120: code 5 (3.0)
    block = torch.cat([s2, scales, codes])
    want = torch.zeros(128)
    want[0], want[1] = 0.5 * 1.0 * 0.5, 6.0 * 1.0 * 0.5
    want[16] = -2.0 * 2.0 * 0.5
    want[63] = -1.0 * -1.0 * 0.5
    want[120] = 3.0 * 0.0625 * 0.5
    assert block.shape == (76,)
    assert torch.equal(reference.dequantize(block, "nvfp4"), want)
    codes[5 * 8] = 0x11  # weights 80, 81 in the group whose scale is 448
    block = torch.cat([s2, scales, codes])
    assert reference.dequantize(block, "nvfp4")[80:82].tolist() == [112.0, 112.0]
    codes[2 * 8] = 0x01  # weight 32 in the subnormal group
    block = torch.cat([s2, scales, codes])
    assert reference.dequantize(block, "nvfp4")[32].item() == 0.5 * 2**-9 * 0.5


def test_dequantize_keeps_outer_dimensions():
    raw = torch.from_numpy(random_blocks("q8_0", 2 * 3 * 2, seed=1)).reshape(2, 3, 68)
    out = reference.dequantize(raw, "q8_0")
    assert out.shape == (2, 3, 64)
    assert torch.equal(out[1, 2], reference.dequantize(raw[1, 2], "q8_0"))
