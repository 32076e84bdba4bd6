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


def test_fp8_rows_carry_their_block_scale():
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(2, 200, 256, generator=g) * 100).to(torch.float8_e4m3fn)
    s = torch.rand(2, 2, 2, generator=g)
    packed = pack.fp8_rows(w, s)
    full = s.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :200]
    assert torch.equal(reference.dequantize(packed, "fp8_e4m3"), w.float() * full)
    with pytest.raises(quant.QuantError, match="needs block scales"):
        pack.fp8_rows(w, s[:, :1])
