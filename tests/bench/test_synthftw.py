"""A benchmark shape written straight to FTW with packed experts: it loads, decodes finite
logits, and `freetoken create` takes it."""

from __future__ import annotations

import json

import torch

from freetoken.bench import synthftw
from freetoken.models.shapes import SHAPES
from freetoken.store import CreateSpec, Store
from tests.runtime.engine_util import full_logits, make_engine


def test_a_shape_written_as_quantized_ftw_loads_and_is_created(tmp_path):
    out = synthftw.write(tmp_path / "tiny-q4", SHAPES["tiny"], "q4_K_M", embed_std=1.0)
    index = json.loads((out / "ftw.json").read_text())
    banks = {
        (t["layer"], t["bank"]): t.get("quant") for t in index["tensors"] if t["kind"] == "bank"
    }
    layers = SHAPES["tiny"]["num_hidden_layers"]
    # gate/up in Q4_K; down's 128-weight rows are not whole Q4_K blocks: Q8_0
    assert banks == {
        (i, b): "q4_k" if b == "gate_up" else "q8_0"
        for i in range(layers)
        for b in ("gate_up", "down")
    }
    assert index["quantize"] == "q4_K_M" and not (tmp_path / "tiny-q4.dense").exists()
    engine = make_engine(out, policy="resident")
    logits = full_logits(engine, [3, 17, 200, 9])
    assert torch.isfinite(logits).all() and float(logits.std()) > 0
    store = Store(tmp_path / "store")
    for _ in store.plan_create(CreateSpec(name="tiny-q4", from_=str(out))).run():
        pass
    assert store.resolve("tiny-q4")
