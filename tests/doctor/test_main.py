"""`freetoken doctor` as a user runs it: the machine, and a model from the store or a
Hugging Face directory, in words and as JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from freetoken.doctor import from_files, from_source
from freetoken.store import Store
from tests.store.conftest import create, write_model_dir


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("doctor")
    store = Store(root / "models")
    create(store, "tiny", from_=str(write_model_dir(root / "hf")))
    return root, store


def doctor(root, *args: str) -> subprocess.CompletedProcess:
    import os

    environ = {**os.environ, "FREETOKEN_MODELS": str(root / "models")}
    environ["FREETOKEN_CACHE_DIR"] = str(root / "cache")
    return subprocess.run(
        [sys.executable, "-m", "freetoken", "doctor", *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_machine(env):
    root, _ = env
    r = doctor(root)
    assert r.returncode == 0, r.stderr
    for key in ("torch", "GPU", "CPU", "RAM", "pinning", "disk", "bandwidth"):
        assert f"\n  {key} " in r.stdout
    assert "experts on the CPU: " in r.stdout and "memlock limit" in r.stdout
    assert "(defaults: run `freetoken bench bw`)" in r.stdout


def test_a_model_in_the_store(env):
    root, _ = env
    r = doctor(root, "tiny", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["model"]["name"] == "tiny:latest" and out["model"]["experts"] > 1
    assert out["verdict"]["fits"] and out["verdict"]["tok_s"] > 0
    words = doctor(root, "tiny").stdout
    assert "tiny:latest: " in words and "  fits" in words and "decode: at most" in words
    assert "warning: num_ctx 4096 is too small for coding agents" in words


def test_facts_of_a_directory_match_the_model_it_converts_to(env, tmp_path):
    root, store = env
    view = store.resolve("tiny")
    files = {k: __import__("pathlib").Path(v) for k, v in store.runner_files(view).items()}
    converted = from_files("tiny", files)
    source = from_source(write_model_dir(tmp_path / "hf"))
    assert not source.converted and source.source_bytes > 0
    assert (source.moe_layers, source.experts, source.experts_per_token) == (
        converted.moe_layers,
        converted.experts,
        converted.experts_per_token,
    )
    assert source.bank_bytes == converted.bank_bytes


def test_an_unknown_model_is_an_error(env):
    root, _ = env
    r = doctor(root, "nosuch")
    assert r.returncode == 1 and r.stderr.startswith("Error: nosuch")
