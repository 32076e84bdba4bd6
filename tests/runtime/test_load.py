"""A load's log says which code serves the CPU experts and what `freetoken doctor` would
say of the model on this machine."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

from freetoken import config
from freetoken.runtime import load
from freetoken.runtime.load import ModelLoad
from freetoken.store import Store
from freetoken.tools import synth
from tests.fixtures import SYNTH_TINY
from tests.store.conftest import create, write_model_dir


def test_the_load_logs_the_doctors_judgement(tmp_path, caplog):
    store = Store(tmp_path / "models")
    create(store, "tiny", from_=str(write_model_dir(tmp_path / "hf")))
    view = store.resolve("tiny")
    files = {k: Path(v) for k, v in store.runner_files(view).items()}
    cfg = config.load({"FREETOKEN_CACHE_DIR": str(tmp_path / "cache")})
    load = ModelLoad({"name": "tiny:latest"}, cfg, files, 4096, 1)
    with caplog.at_level(logging.INFO, logger="freetoken.runner"):
        load.log_judgement()
    lines = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("doctor: host RAM: ") for m in lines)
    assert any(m.startswith("doctor: decode: at most ") for m in lines)
    assert any(m.startswith("doctor: warning: num_ctx 4096 is too small") for m in lines)


def test_a_model_without_an_index_is_logged_not_failed(tmp_path, caplog):
    cfg = config.load({"FREETOKEN_CACHE_DIR": str(tmp_path / "cache")})
    load = ModelLoad({"name": "x"}, cfg, {"model.gguf": tmp_path / "x.gguf"}, 4096, 1)
    with caplog.at_level(logging.INFO, logger="freetoken.runner"):
        load.log_judgement()
    assert "doctor: no judgement for x" in caplog.text


def test_the_placement_names_the_weights_whose_hot_experts_are_kept(tmp_path):
    """The same weights under two names share a key; other weights, or none, do not."""
    store = Store(tmp_path / "models")
    create(store, "tiny", from_=str(write_model_dir(tmp_path / "hf")))
    create(store, "again", from_=str(write_model_dir(tmp_path / "hf")))
    cfg = config.load({"FREETOKEN_CACHE_DIR": str(tmp_path / "cache")})

    def key(name):
        files = {k: Path(v) for k, v in store.runner_files(store.resolve(name)).items()}
        return ModelLoad({"name": name}, cfg, files, 4096, 1).placement().model_key

    assert key("tiny") and key("tiny") == key("again")
    synth.write_qwen3_moe(tmp_path / "hf2", **{**SYNTH_TINY, "seed": 5})
    create(store, "other", from_=str(tmp_path / "hf2"))
    assert key("other") not in ("", key("tiny"))
    gguf = ModelLoad({"name": "x"}, cfg, {"model.gguf": tmp_path / "x.gguf"}, 4096, 1)
    assert gguf.placement().model_key == ""


def test_a_failed_warm_up_leaves_the_graphs_to_capture_when_first_run(caplog):
    """Warming the decode graphs at load is a speed-up only: its failure is logged and the
    load goes on with no graph kept."""
    reset = []

    def warm(pool):
        raise RuntimeError("capture failed")

    graphs = SimpleNamespace(warm=warm, reset=lambda: reset.append(True))
    load._warm(graphs, SimpleNamespace(pool=None))
    assert reset == [True] and "warming failed" in caplog.text
