"""The block formats' declarations (freetoken/quant) against GGUF's own type table."""

from __future__ import annotations

import pytest

from freetoken import quant


@pytest.mark.parametrize("fmt", [f for f in quant.FORMATS.values() if f.ggml_type is not None])
def test_ggml_formats_have_gguf_block_sizes(fmt):
    import gguf

    qtype = gguf.GGMLQuantizationType(fmt.ggml_type)
    assert qtype.name.lower() == fmt.name
    assert gguf.GGML_QUANT_SIZES[qtype] == (fmt.block, fmt.block_bytes)


def test_codes_are_distinct_and_rows_pack_whole_blocks():
    assert len({f.code for f in quant.FORMATS.values()}) == len(quant.FORMATS)
    q4k = quant.get("q4_k")
    assert q4k.packed_shape((8, 768, 2048)) == (8, 768, 2048 // 256 * 144)
    assert q4k.logical_cols(8 * 144) == 2048
    assert quant.get("fp8_e4m3").row_bytes(256) == 264
    assert quant.get("nvfp4").row_bytes(256) == 152 and quant.get("nvfp4").bits == 4.75
    with pytest.raises(quant.QuantError, match="multiples of 256"):
        q4k.row_bytes(100)
    with pytest.raises(quant.QuantError, match="unknown quantized format 'q3_k'"):
        quant.get("q3_k")
