"""A model directory in the Hugging Face layout, made without torch: the store never reads
weights, so the tensors need not be real (the API tests use a real model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from freetoken.store import CreateSpec, Store
from freetoken.tools import synth
from tests.fixtures import SYNTH_TINY

TEMPLATE_WITH_TOOLS = (
    "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}{{ tools }}{% endif %}"
)


def write_model_dir(path: Path, **config_overrides) -> Path:
    """A real (random-weight) model: create converts its weights to FTW."""
    synth.write_qwen3_moe(path, **SYNTH_TINY)
    if config_overrides:
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, **config_overrides}))
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(
        json.dumps({**tok_cfg, "chat_template": TEMPLATE_WITH_TOOLS})
    )
    (path / "README.md").write_text("not part of the model")
    return path


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_model_dir(tmp_path / "hf")


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "models")


def create(store: Store, name: str, **fields) -> list[dict]:
    return list(store.plan_create(CreateSpec(name=name, **fields)).run())
