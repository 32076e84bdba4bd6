"""Quantized checkpoints into FTW: GGUF blocks, FP8 and NVFP4 checkpoints stay packed, byte
for byte; other GGUF types are decoded to BF16 with a note; bad input names the tensor and
writes nothing."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken.ftw import reader
from freetoken.ftw.convert import convert
from freetoken.weights import WeightsError
from tests import fixtures
from tests.fixtures_gguf import dequantized_state, write_gguf
from tests.runtime.engine_util import files_of, full_logits, make_engine

PROMPT = [5, 17, 99, 3, 250, 11, 7, 300]
KEPT = ["Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"]


@pytest.fixture(scope="module")
def k_model(tmp_path_factory):
    """Rows of 256 weights (whole K-quant blocks), experts large next to the alignment."""
    path = tmp_path_factory.mktemp("tiny-256")
    hf = fixtures.hf_qwen3_moe(
        path, seed=4, hidden_size=256, moe_intermediate_size=256, num_experts=4
    )
    return path, hf


def _raw(gguf_path, name: str) -> torch.Tensor:
    import gguf

    t = next(t for t in gguf.GGUFReader(str(gguf_path)).tensors if t.name == name)
    return torch.from_numpy(np.array(t.data, dtype=np.uint8))


def _size(path) -> int:
    return sum(f.stat().st_size for f in path.iterdir())


@pytest.mark.parametrize("qtype", KEPT)
def test_gguf_blocks_stay_as_they_are(k_model, tmp_path, qtype):
    path, hf = k_model
    gguf = write_gguf(hf, path, tmp_path / "m.gguf", qtype)
    out = convert(gguf, tmp_path / "ftw")
    index = {t["name"]: t for t in json.loads((out / "ftw.json").read_text())["tensors"]}
    entry = index["gate_up#L00001"]
    assert (entry["quant"], entry["dtype"], entry["shape"]) == (
        qtype.lower(),
        "uint8",
        [4, 512, 256],
    )
    assert index["model.embed_tokens.weight"]["quant"] == qtype.lower()
    w = reader.read(files_of(out), pin=False)
    halves = [_raw(gguf, f"blk.1.ffn_{p}_exps.weight") for p in ("gate", "up")]
    assert torch.equal(w.banks[(1, "gate_up")], torch.cat(halves, dim=1))
    assert torch.equal(w.banks[(0, "down")], _raw(gguf, "blk.0.ffn_down_exps.weight"))
    assert w.formats[(1, "gate_up")] == qtype.lower()
    assert _size(out) <= 1.3 * gguf.stat().st_size
    # compute in BF16 unless asked: the model is quantized
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_other_gguf_types_are_decoded_to_bf16_and_said_so(k_model, tmp_path):
    path, hf = k_model
    gguf = write_gguf(hf, path, tmp_path / "m.gguf", "F32")
    q5_0 = write_gguf(hf, path, tmp_path / "q.gguf", "Q5_0")
    notes: list[str] = []
    out = convert(q5_0, tmp_path / "ftw", note=notes.append)
    assert notes == ["dequantizing Q5_0 tensors to BF16 (no kernel reads them packed)"]
    w = reader.read(files_of(out), pin=False)
    assert w.banks[(0, "down")].dtype == torch.bfloat16 and not w.formats
    ref = dequantized_state(q5_0)["blk.0.ffn_down_exps.weight"]
    assert torch.equal(w.banks[(0, "down")], ref.to(torch.bfloat16))
    f32 = convert(gguf, tmp_path / "f32")
    assert json.loads((f32 / "config.json").read_text())["torch_dtype"] == "float32"


def _patch_type(path, name: str, code: int) -> None:
    """Rewrites a tensor's GGUF type number in the file's tensor table."""
    data = bytearray(path.read_bytes())
    at = data.index(name.encode()) + len(name)
    n_dims = int.from_bytes(data[at : at + 4], "little")
    at += 4 + 8 * n_dims
    data[at : at + 4] = code.to_bytes(4, "little")
    path.write_bytes(bytes(data))


def test_bad_gguf_tensors_are_named_and_nothing_is_written(k_model, tmp_path):
    import gguf as gg

    path, hf = k_model
    unknown = write_gguf(hf, path, tmp_path / "u.gguf", "Q4_K")
    _patch_type(unknown, "blk.0.ffn_down_exps.weight", 99)
    with pytest.raises(WeightsError, match="tensor blk.0.ffn_down_exps.weight: unknown GGUF"):
        convert(unknown, tmp_path / "u")
    short = tmp_path / "s.gguf"
    w = gg.GGUFWriter(str(short), "qwen3moe")
    w.add_tensor("a.weight", np.zeros((3, 144), np.uint8), raw_shape=(4, 144), raw_dtype=12)
    w.add_tensor("b.weight", np.ones((4, 8), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(WeightsError, match=r"tensor a.weight: Q4_K \[4, 256\] needs 576 bytes"):
        convert(short, tmp_path / "s")
    assert not any(p.name.startswith(("u", "s")) and p.is_dir() for p in tmp_path.iterdir())


def _quantized_model(tmp_path_factory, write, seed: int):
    """A tiny Qwen3-MoE (its BF16 directory, its quantized copy by `write`) and the
    transformers model computing with what the quantized weights decode to."""
    src = tmp_path_factory.mktemp("bf16")
    hf = fixtures.hf_qwen3_moe(
        src, seed=seed, hidden_size=128, moe_intermediate_size=128, head_dim=32, num_experts=4
    )
    out = tmp_path_factory.mktemp("quantized") / "m"
    decoded = write(src, out)
    ref = tmp_path_factory.mktemp("decoded")
    for f in src.iterdir():
        (ref / f.name).write_bytes(f.read_bytes())
    save_file({**load_file(src / "model.safetensors"), **decoded}, ref / "model.safetensors")
    hf = type(hf).from_pretrained(ref, dtype=torch.float32).eval()
    return src, out, hf


def _stays_packed(model, tmp_path, quant: str, scale_parts: tuple[str, ...]) -> None:
    """Converted, its experts and attention matrices keep `quant` (their scales folded in),
    the embedding stays float, and the logits are transformers'."""
    _, path, hf = model
    out = convert(path, tmp_path / "ftw")
    index = {t["name"]: t for t in json.loads((out / "ftw.json").read_text())["tensors"]}
    assert index["down#L00000"]["quant"] == quant
    assert index["model.layers.0.self_attn.q_proj.weight"]["quant"] == quant
    assert "quant" not in index["model.embed_tokens.weight"]
    assert not any(part in n for n in index for part in scale_parts)
    ours = full_logits(make_engine(out, dtype="float32"), PROMPT)
    assert float((ours - fixtures.hf_logits(hf, PROMPT)).norm() / ours.norm()) <= 1e-4


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    """A tiny Qwen3-MoE whose experts and attention matrices are FP8 with block scales."""
    from tests.fixtures_quant import write_fp8

    return _quantized_model(tmp_path_factory, write_fp8, seed=5)


def test_fp8_checkpoint_stays_fp8_and_computes_its_weights(fp8_model, tmp_path):
    _stays_packed(fp8_model, tmp_path, "fp8_e4m3", ("_scale_inv",))


def test_fp8_weight_without_its_scale_is_named(fp8_model, tmp_path):
    from tests.fixtures_quant import write_fp8

    src, _, _ = fp8_model
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    bad = tmp_path / "bad"
    write_fp8(src, bad, drop_scale=name)
    with pytest.raises(WeightsError, match=f"tensor {name}_scale_inv is missing: {name}"):
        convert(bad, tmp_path / "ftw")
    assert not (tmp_path / "ftw").exists() and not (tmp_path / "ftw.partial").exists()


@pytest.fixture(scope="module")
def nvfp4_model(tmp_path_factory):
    """A tiny Qwen3-MoE whose experts and attention matrices are ModelOpt NVFP4."""
    from tests.fixtures_quant import write_nvfp4

    return _quantized_model(tmp_path_factory, write_nvfp4, seed=6)


def test_nvfp4_checkpoint_stays_nvfp4_and_computes_its_weights(nvfp4_model, tmp_path):
    _stays_packed(nvfp4_model, tmp_path, "nvfp4", ("_scale", "_scale_2"))


def _copy_with_config(src, dst, edit):
    """A copy of the model directory `src` whose config.json `edit` changed in place."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_modelopt_other_than_nvfp4_is_refused(nvfp4_model, tmp_path):
    src, _, _ = nvfp4_model
    fp8 = {"quant_method": "modelopt", "quant_algo": "FP8"}
    bad = _copy_with_config(
        src, tmp_path / "fp8-modelopt", lambda c: c.update(quantization_config=fp8)
    )
    with pytest.raises(WeightsError, match="ModelOpt FP8 checkpoints are not supported"):
        convert(bad, tmp_path / "ftw")


def test_nvfp4_declared_only_in_hf_quant_config_converts_alike(nvfp4_model, tmp_path):
    """A ModelOpt export whose config.json names no quantization and whose
    hf_quant_config.json does: converted as the same NVFP4 checkpoint, to the same logits."""
    src, path, hf = nvfp4_model
    q = {}
    bare = _copy_with_config(
        path, tmp_path / "bare", lambda c: q.update(c.pop("quantization_config"))
    )
    quant_file = {"producer": {"name": "modelopt"}, "quantization": {**q, "exclude_modules": []}}
    (bare / "hf_quant_config.json").write_text(json.dumps(quant_file))
    _stays_packed((src, bare, hf), tmp_path, "nvfp4", ("_scale", "_scale_2"))
    (bare / "hf_quant_config.json").unlink()  # without it the packed tensors are unexplained
    with pytest.raises(WeightsError, match="weight_scale holds NVFP4 group scales, but the check"):
        convert(bare, tmp_path / "again")
