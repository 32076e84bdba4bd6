"""A model directory in the Hugging Face layout, made without torch: the store never reads
weights, so the tensors need not be real (the API tests use a real model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from freetoken.store import CreateSpec, Store
from freetoken.tools import synth

TEMPLATE_WITH_TOOLS = (
    "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}{{ tools }}{% endif %}"
)


def write_model_dir(path: Path, **config_overrides) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(synth.qwen3_moe_config(512, **config_overrides)))
    (path / "model.safetensors").write_bytes(b"\0" * 4096)
    (path / "tokenizer.json").write_text("{}")
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE_WITH_TOOLS}))
    (path / "generation_config.json").write_text("{}")
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
