"""What doctor reads of quantized models: expert banks count their blocks' bytes (they stay
packed in host memory), dense weights the BF16 they are decoded to; a source not created yet
is judged as the FTW it converts to."""

from __future__ import annotations

import pytest

from freetoken.doctor import from_files, from_source
from freetoken.ftw.convert import convert
from tests import fixtures
from tests.fixtures_gguf import write_gguf
from tests.fixtures_quant import write_fp8


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """Rows of 256 weights: whole K-quant and FP8 blocks."""
    path = tmp_path_factory.mktemp("hf")
    model = fixtures.hf_qwen3_moe(
        path, seed=5, hidden_size=256, moe_intermediate_size=256, num_experts=4
    )
    return path, model


def _converted(src, out):
    return from_files("m", {p.name: p for p in convert(src, out).iterdir()})


def test_a_q4_k_m_gguf_is_judged_by_its_blocks(hf, tmp_path):
    gguf = write_gguf(hf[1], hf[0], tmp_path / "m.gguf", "Q4_K_M")
    source, converted = from_source(gguf), _converted(gguf, tmp_path / "ftw")
    assert source.bank_bytes == converted.bank_bytes
    c = hf[1].config
    bf16 = 3 * c.hidden_size * c.moe_intermediate_size * c.num_experts * c.num_hidden_layers * 2
    assert converted.bank_bytes < bf16 / 3  # 4.5 and 6.6 bits a weight, not 16
    embed = c.vocab_size * c.hidden_size
    assert converted.dense_bytes >= 2 * embed * 2  # the packed embedding and head, decoded


def test_an_fp8_checkpoint_is_judged_by_its_blocks(hf, tmp_path):
    write_fp8(hf[0], tmp_path / "fp8")
    source, converted = from_source(tmp_path / "fp8"), _converted(tmp_path / "fp8", tmp_path / "o")
    assert source.bank_bytes == converted.bank_bytes
