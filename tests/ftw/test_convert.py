"""Converters: HF directory and GGUF files to FTW, checked against transformers."""

from __future__ import annotations

import pytest
import torch

from freetoken.ftw.convert import convert
from freetoken.kernels import reference
from tests import fixtures
from tests.fixtures_gguf import dequantized_state, write_gguf
from tests.runtime.engine_util import files_of, full_logits, generate, make_engine

PROMPT = [5, 17, 99, 3, 250, 11, 7, 300]


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_model_sharded"])
def test_hf_to_ftw_gives_identical_logits(fixture, request, tmp_path):
    path, _ = request.getfixturevalue(fixture)
    out = convert(path, tmp_path / "ftw", shard_limit=64 * 4096)
    direct = full_logits(make_engine(path), PROMPT)
    via_ftw = full_logits(make_engine(out), PROMPT)
    assert torch.equal(direct, via_ftw)
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(files_of(out))


@pytest.fixture(scope="module")
def k_quant_model(tmp_path_factory):
    # K-quants need rows that are multiples of 256
    path = tmp_path_factory.mktemp("tiny-256")
    return path, fixtures.hf_qwen3_moe(
        path,
        seed=4,
        hidden_size=256,
        moe_intermediate_size=256,
        intermediate_size=256,
        num_experts=4,
    )


def test_gguf_f32_matches_transformers(tiny_model, tmp_path):
    path, hf = tiny_model
    gguf = write_gguf(hf, path, tmp_path / "m.gguf", "F32")
    out = convert(gguf, tmp_path / "ftw")
    engine = make_engine(out)
    logits = full_logits(engine, PROMPT)
    # the same weights as the Hugging Face directory, bit for bit
    assert torch.equal(logits, full_logits(make_engine(path), PROMPT))
    assert _rel(logits, fixtures.hf_logits(hf, PROMPT)) <= 1e-5
    (seq,) = generate(engine, [PROMPT], 16)
    assert seq.output_ids == fixtures.hf_greedy(hf, PROMPT, 16)


@pytest.mark.parametrize(
    "qtype,tol", [("F16", 0.01), ("BF16", 0.05), ("Q8_0", 0.05), ("Q4_0", 0.5), ("Q4_K", 0.5)]
)
def test_quantized_gguf_loads_the_dequantized_weights(k_quant_model, tmp_path, qtype, tol):
    path, hf = k_quant_model
    gguf = write_gguf(hf, path, tmp_path / "m.gguf", qtype)
    out = convert(gguf, tmp_path / "ftw")
    engine = make_engine(out, dtype="float32")
    # the weights are exactly gguf's own dequantization (packed ones, once decoded)
    ref = dequantized_state(gguf)
    host = engine.model.model.layers[0].mlp.experts.backend.banks
    bank, fmt = host.banks[0]["gate_up"], host.specs[0].format_of("gate_up")
    assert fmt == ("" if qtype in ("F16", "BF16") else qtype.lower())
    values = reference.dequantize(bank, fmt) if fmt else bank
    assert torch.equal(
        values, torch.cat([ref["blk.0.ffn_gate_exps.weight"], ref["blk.0.ffn_up_exps.weight"]], 1)
    )
    # and the logits stay near the unquantized model's
    assert _rel(full_logits(engine, PROMPT), fixtures.hf_logits(hf, PROMPT)) <= tol


def test_bare_gguf_loads_without_conversion(tiny_model, tmp_path):
    from freetoken.runtime import loader

    path, hf = tiny_model
    gguf = write_gguf(hf, path, tmp_path / "m.gguf", "F32")
    files = loader.with_gguf_metadata({"m.gguf": gguf}, tmp_path / "meta")
    loaded = loader.load(files, "cpu")
    assert loaded.config["num_experts"] == hf.config.num_experts


def test_a_model_beyond_the_memory_available_is_refused_at_conversion(
    tiny_model, tmp_path, monkeypatch
):
    """Converting a checkpoint this host could not hold to serve stops before writing, with
    the numbers: the tensors the model reads, not the ones it ignores."""
    from freetoken.ftw import reader
    from freetoken.models.qwen3_moe import Model
    from freetoken.weights.safetensors_dir import Checkpoint

    path, hf = tiny_model
    with Checkpoint(files_of(path), Model) as ck:
        assert ck.nbytes() == sum(t.numel() * 4 for t in hf.state_dict().values())
    monkeypatch.setattr(reader, "mem_available", lambda: 4096)
    with pytest.raises(reader.HostMemoryError, match=r"GiB of host memory and 0\.0 GiB is"):
        convert(path, tmp_path / "ftw")
    assert not (tmp_path / "ftw").exists()


def test_a_split_gguf_converts_as_the_whole_file(tiny_model, tmp_path):
    """llama.cpp's gguf-split parts (here written by gguf's own writer), named by any part:
    the same weights as the whole file; a missing part is named."""
    from freetoken.runtime import loader
    from freetoken.weights import WeightsError

    path, hf = tiny_model
    whole = write_gguf(hf, path, tmp_path / "whole.gguf", "F32")
    (tmp_path / "split").mkdir()
    first = write_gguf(hf, path, tmp_path / "split" / "m.gguf", "F32", split_max_tensors=12)
    parts = sorted(first.parent.glob("m-*-of-*.gguf"))
    assert first == parts[0] and len(parts) > 2
    expected = full_logits(make_engine(convert(whole, tmp_path / "ftw-whole")), PROMPT)
    out = convert(parts[1], tmp_path / "ftw-split")
    assert torch.equal(full_logits(make_engine(out), PROMPT), expected)
    files = loader.with_gguf_metadata({p.name: p for p in parts}, tmp_path / "meta")
    assert loader.load(files, "cpu").config["num_experts"] == hf.config.num_experts
    parts[-1].unlink()
    with pytest.raises(WeightsError, match=f"missing beside it: {parts[-1].name}"):
        convert(first, tmp_path / "ftw-missing")
