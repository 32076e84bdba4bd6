"""Quantizing float weights (quant/quantize.py) and repacking checkpoints' own layouts
(quant/pack.py): what decoding gives back, checked with gguf's own dequantizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken import quant
from freetoken.kernels import reference
from freetoken.quant import pack
from freetoken.quant.quantize import expert_format, quantize

# relative error of a round trip on Gaussian weights (a plain range fit of Q4_K reaches 0.078)
TOLERANCE = {"q8_0": 0.008, "q6_k": 0.025, "q5_k": 0.045, "q4_k": 0.08}


@pytest.mark.parametrize("fmt", list(TOLERANCE))
def test_round_trip_error_is_small_and_gguf_reads_the_blocks(fmt):
    import gguf

    g = torch.Generator().manual_seed(quant.get(fmt).code)
    w = torch.randn(8, 512, generator=g) * 0.02
    w[0, :256] = 0  # an all-zero block decodes to zeros
    packed = quantize(w, fmt)
    assert packed.dtype == torch.uint8 and packed.shape == quant.get(fmt).packed_shape(w.shape)
    back = reference.dequantize(packed, fmt)
    assert float((back - w).norm() / w.norm()) <= TOLERANCE[fmt]
    assert torch.equal(back[0, :256], torch.zeros(256))
    theirs = gguf.quants.dequantize(packed.numpy(), gguf.GGMLQuantizationType[fmt.upper()])
    torch.testing.assert_close(back, torch.from_numpy(np.asarray(theirs)), rtol=1e-6, atol=0)


def test_expert_formats_follow_q4_k_m():
    n = 48
    downs = [expert_format("q4_K_M", "down", i, n, 768) for i in range(n)]
    assert downs[:6] == ["q6_k"] * 6 and downs[-6:] == ["q6_k"] * 6
    assert downs[6:9] == ["q4_k", "q4_k", "q6_k"]
    assert {expert_format("q4_K_M", "gate_up", i, n, 2048) for i in range(n)} == {"q4_k"}
    assert expert_format("q4_K_M", "gate_up", 0, n, 2880) == "q8_0"  # not whole 256 blocks
    assert expert_format("q8_0", "down", 0, n, 100) is None
    with pytest.raises(quant.QuantError, match="unknown quantization 'q3_K_S'"):
        expert_format("q3_K_S", "down", 0, n, 768)


def test_mxfp4_from_hf_decodes_as_the_hf_layout():
    """gpt-oss's layout decoded directly (weight 2b in the low nibble of byte b, 2^(s-127))
    equals the repacked block's decoding."""
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(115, 135, (3, 5, 4), generator=g, dtype=torch.uint8)
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).reshape(3, 5, 4, 32)
    scale = torch.exp2(scales.float() - 127)[..., None]
    values = torch.tensor(reference.E2M1)[codes.long()] * scale
    packed = pack.mxfp4_from_hf(blocks, scales)
    assert packed.shape == (3, 5, 4 * 17)
    assert torch.equal(reference.dequantize(packed, "mxfp4"), values.reshape(3, 5, 128))


def test_mxfp4_rows_decode_deepseek_v4s_fp4_experts():
    """DeepSeek-V4's experts: float4_e2m1fn_x2 codes [R, C/2] (the first of each pair in the
    low nibble) with float8_e8m0fnu scales [R, C/32], decoded element by element."""
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (2, 6, 64), generator=g, dtype=torch.uint8)
    bits = torch.randint(118, 134, (2, 6, 2), generator=g, dtype=torch.uint8)
    weight = (codes[..., 0::2] | codes[..., 1::2] << 4).view(torch.float4_e2m1fn_x2)
    scale = bits.view(torch.float8_e8m0fnu)
    values = torch.tensor(reference.E2M1)[codes.long()]
    values = values * scale.float().repeat_interleave(32, dim=-1)
    packed = pack.mxfp4_rows(weight, scale)
    assert torch.equal(reference.dequantize(packed, "mxfp4"), values)
    assert torch.equal(pack.mxfp4_rows(weight.view(torch.uint8), bits), packed)  # as bytes
    with pytest.raises(quant.QuantError, match="one e8m0 scale a 32 weights"):
        pack.mxfp4_rows(weight, scale[..., :1])


def test_fp8_rows_take_e8m0_block_scales():
    """DeepSeek-V4's FP8 weights carry powers of two (float8_e8m0fnu) as their scales."""
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(1, 130, 256, generator=g) * 100).to(torch.float8_e4m3fn)
    bits = torch.randint(120, 130, (1, 2, 2), generator=g, dtype=torch.uint8)
    e8m0 = pack.fp8_rows(w, bits.view(torch.float8_e8m0fnu))
    assert torch.equal(e8m0, pack.fp8_rows(w, torch.exp2(bits.float() - 127)))


def test_fp8_rows_carry_their_block_scale():
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(2, 200, 256, generator=g) * 100).to(torch.float8_e4m3fn)
    s = torch.rand(2, 2, 2, generator=g)
    packed = pack.fp8_rows(w, s)
    full = s.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :200]
    assert torch.equal(reference.dequantize(packed, "fp8_e4m3"), w.float() * full)
    with pytest.raises(quant.QuantError, match="needs block scales"):
        pack.fp8_rows(w, s[:, :1])


def test_nvfp4_round_trip_scales_and_zeros():
    """NVIDIA's recipe: one tensor scale amax / (6·448) in every block, group scales e4m3
    (the largest group's 448), codes the nearest e2m1; an all-zero group decodes to zeros."""
    g = torch.Generator().manual_seed(8)
    w = torch.randn(8, 512, generator=g) * 0.02
    w[1, 32:48] = 0
    packed = quantize(w, "nvfp4")
    assert packed.shape == (8, 4 * 76)
    s2 = packed.reshape(-1, 76)[:, :4].contiguous().view(torch.float32)
    assert torch.equal(s2, torch.full_like(s2, float(w.abs().amax() / (6 * 448))))
    scales = packed.reshape(-1, 76)[:, 4:12].contiguous().view(torch.float8_e4m3fn).float()
    assert float(scales.max()) == 448.0
    back = reference.dequantize(packed, "nvfp4")
    assert float((back - w).norm() / w.norm()) <= 0.11
    assert torch.equal(back[1, 32:48], torch.zeros(16))
    # each weight decodes to the e2m1 value nearest it on its group's scale
    step = (scales * s2).repeat_interleave(16, dim=1).reshape(8, 512)
    assert bool(((back - w).abs() <= step + 1e-12).all())


def test_nvfp4_from_modelopt_decodes_as_the_checkpoint_layout():
    """ModelOpt's codes (column 2i in byte i's low nibble), e4m3 scales per 16 columns and
    scalar weight_scale_2, decoded directly in float64, against the repacked blocks."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randint(0, 256, (2, 5, 128), generator=g, dtype=torch.uint8)
    scale_bits = torch.randint(0, 127, (2, 5, 16), generator=g, dtype=torch.uint8)  # no NaN
    weight_scale = scale_bits.view(torch.float8_e4m3fn)
    s2 = torch.tensor(0.0123)
    codes = torch.stack([weight & 15, weight >> 4], dim=-1).reshape(2, 5, 256)
    per_col = weight_scale.double().repeat_interleave(16, dim=-1)
    direct = torch.tensor(reference.E2M1, dtype=torch.float64)[codes.long()] * per_col
    direct = direct * s2.double()
    packed = pack.nvfp4_from_modelopt(weight, weight_scale, s2)
    assert packed.shape == (2, 5, 2 * 76)
    torch.testing.assert_close(
        reference.dequantize(packed, "nvfp4").double(), direct, rtol=1e-6, atol=0
    )
    assert torch.equal(pack.nvfp4_from_modelopt(weight, scale_bits, s2.reshape(1)), packed)
    with pytest.raises(quant.QuantError, match="needs scales"):
        pack.nvfp4_from_modelopt(weight, weight_scale[..., :8], s2)
    with pytest.raises(quant.QuantError, match="whole 128-weight blocks"):
        pack.nvfp4_from_modelopt(weight[..., :32], weight_scale[..., :4], s2)
