"""`create --quantize`: a float model's experts quantized while it enters the store, from a
directory, from uploaded files, or from a model already there."""

from __future__ import annotations

import json

import pytest
import torch

from freetoken.runtime import loader
from freetoken.store import CreateError, CreateSpec
from freetoken.tools import synth
from tests.fixtures import SYNTH_TINY
from tests.runtime.engine_util import files_of, full_logits, make_engine

from .conftest import create


def _index(store, name: str) -> dict:
    view = store.resolve(name)
    return json.loads(store.blobs.path(view.files["ftw.json"]).read_text())


def _model_dir(store, name: str, tmp_path):
    """The stored model's files under their names (what a runner is given)."""
    d = tmp_path / name
    d.mkdir()
    for n, digest in store.resolve(name).files.items():
        (d / n).symlink_to(store.blobs.path(digest))
    return d


@pytest.mark.parametrize("qtype", ["q8_0", "Q4_K_M"])
def test_a_directory_is_quantized_on_its_way_in(store, tmp_path, qtype):
    src = synth.write_qwen3_moe(tmp_path / "hf", **{**SYNTH_TINY, "moe_intermediate_size": 32})
    statuses = [e["status"] for e in create(store, "q", from_=str(src), quantize=qtype)]
    canonical = {"q8_0": "q8_0", "Q4_K_M": "q4_K_M"}[qtype]
    assert f"quantizing the experts to {canonical}" in statuses and statuses[-1] == "success"
    index = _index(store, "q")
    banks = {t["name"]: t.get("quant") for t in index["tensors"] if t["kind"] == "bank"}
    # rows of 64 weights: Q4_K_M falls back to Q8_0 (K-quants need 256)
    assert set(banks.values()) == {"q8_0"}
    assert index["quantize"] == canonical
    assert store.resolve("q").info["file_type"] == canonical.upper()
    plain = create(store, "plain", from_=str(src))[-1]
    assert plain["status"] == "success"
    quantized = _model_dir(store, "q", tmp_path)
    assert loader.load(files_of(quantized), "cpu").dtype == torch.bfloat16  # unless asked
    ours = full_logits(make_engine(quantized, dtype="float32"), [1, 2, 3])
    ref = full_logits(make_engine(_model_dir(store, "plain", tmp_path)), [1, 2, 3])
    assert float((ours - ref).norm() / ref.norm()) <= 0.02


def test_a_stored_model_is_quantized_into_a_new_one(store, tmp_path):
    src = synth.write_qwen3_moe(tmp_path / "hf", **{**SYNTH_TINY, "moe_intermediate_size": 32})
    create(store, "base", from_=str(src), system="be brief")
    create(store, "small", from_="base", quantize="q8_0")
    index = _index(store, "small")
    assert {t.get("quant") for t in index["tensors"] if t["kind"] == "bank"} == {"q8_0"}
    assert store.resolve("small").system == "be brief"  # the small layers carry over
    assert store.resolve("base").files != store.resolve("small").files
    with pytest.raises(CreateError, match="already quantized .q8_0.: quantizing needs a BF16"):
        create(store, "smaller", from_="small", quantize="q8_0")
    with pytest.raises(CreateError, match="unsupported quantization type 'q2_K'"):
        store.plan_create(CreateSpec("x", from_="base", quantize="q2_K"))
