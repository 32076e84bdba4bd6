"""Memory-aware residency through the real server and Runner class: the machine's figures
come from a MemoryProbe of the test's, the runners are stand-ins reporting chosen sizes
(fake_runner.py), the models are real FTW models (the estimate reads their index)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from freetoken import doctor
from freetoken.doctor.memory import Free
from freetoken.server.residency import Residency
from freetoken.store import Store

from .harness import LiveServer, add_model, make_config

GiB = 2**30
FAKE = Path(__file__).with_name("fake_runner.py")


@dataclass
class Machine:
    """The test's MemoryProbe: whatever figures the test sets."""

    figures: Free

    def free(self) -> Free:
        return self.figures


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    store = Store(root)
    add_model(store, "a")
    for name in ("b", "c"):
        store.copy("a", name)
    return root


@pytest.fixture
def server(models, tmp_path):
    """(server, its Machine, the sizes file its runners report, what a load of `a` needs)."""
    sizes = tmp_path / "sizes.json"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE} {sizes} "$@"\n')
    python.chmod(0o755)
    cfg = make_config(models, FREETOKEN_RUNNER_PYTHON=str(python), FREETOKEN_CONTEXT_LENGTH="128")
    store = Store(models)
    files = {k: Path(v) for k, v in store.runner_files(store.resolve("a")).items()}
    needs = doctor.needs(doctor.from_files("a", files), 128, cfg, on_gpu=True)
    # each stand-in holds what the estimate says: host memory, and the GPU part as 4 slots
    per_slot = needs.cache // 4
    one = {"host": needs.host, "dense_vram": needs.vram - 4 * per_slot, "expert_bytes": per_slot}
    sizes.write_text(json.dumps({f"{m}:latest": {**one, "slots": 4} for m in "abc"}))
    machine = Machine(Free(64 * GiB, gpu=True, vram=80 * GiB))
    with LiveServer(cfg, Residency(cfg, memory=machine)) as srv:
        yield srv, machine, sizes, needs


def load(srv: LiveServer, name: str) -> httpx.Response:
    return httpx.post(f"{srv.url}/api/generate", json={"model": name}, timeout=60)


def loaded(srv: LiveServer) -> list[str]:
    return [m["name"] for m in httpx.get(f"{srv.url}/api/ps").json()["models"]]


def test_a_model_that_cannot_fit_even_alone_is_refused_in_each_apis_shape(server):
    srv, machine, _, needs = server
    machine.figures = Free(64 * GiB, gpu=True, vram=needs.vram // 2)
    r = load(srv, "a")
    assert r.status_code == 500
    msg = r.json()["error"]
    assert msg.startswith("model 'a:latest' does not fit: it needs ") and "GPU memory" in msg
    assert "is free with no other model loaded" in msg
    chat = {"model": "a", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 500 and r.json()["error"]["message"] == msg
    assert r.json()["error"]["type"] == "api_error"
    r = httpx.post(f"{srv.url}/v1/messages", json={**chat, "max_tokens": 8}, timeout=60)
    assert r.status_code == 500 and r.json()["type"] == "error"
    assert r.json()["error"] == {"type": "api_error", "message": msg}
    machine.figures = Free(needs.host // 2, gpu=True, vram=80 * GiB)
    r = load(srv, "a")
    assert r.status_code == 500 and "of host memory for its expert banks" in r.json()["error"]
    assert loaded(srv) == []  # no runner was started for either


def test_idle_models_are_unloaded_least_recently_used_first(server):
    srv, machine, sizes, needs = server
    assert load(srv, "a").status_code == 200 and load(srv, "b").status_code == 200
    assert load(srv, "a").status_code == 200  # a used last: b is the least recently used
    # The GPU now has room for less than one more model; each loaded one holds a whole one.
    machine.figures = Free(64 * GiB, gpu=True, vram=needs.vram // 2)
    assert load(srv, "c").status_code == 200
    assert sorted(loaded(srv)) == ["a:latest", "c:latest"]
    # a's cache shrank (its VRAM watcher gave memory back): it now holds half a model's VRAM
    table = json.loads(sizes.read_text())
    table["a:latest"].update(dense_vram=needs.vram // 2, slots=0)
    sizes.write_text(json.dumps(table))
    machine.figures = Free(64 * GiB, gpu=True, vram=0)
    assert load(srv, "b").status_code == 200
    assert loaded(srv) == ["b:latest"]  # a, least recently used, was not enough: c went too


def test_ps_reports_the_sizes_after_a_resize(server):
    srv, _, sizes, needs = server
    assert load(srv, "a").status_code == 200
    [before] = httpx.get(f"{srv.url}/api/ps").json()["models"]
    per_slot = json.loads(sizes.read_text())["a:latest"]["expert_bytes"]
    assert before["size_vram"] == needs.vram and before["size"] == needs.host + needs.vram
    r = httpx.post(f"{srv.url}/api/cache/resize", json={"model": "a", "slots": 10})
    assert r.status_code == 200 and r.json()["slots"] == 10
    [after] = httpx.get(f"{srv.url}/api/ps").json()["models"]
    assert after["size_vram"] == before["size_vram"] + 6 * per_slot
    assert after["size"] == before["size"] + 6 * per_slot
    assert after["expert_cache_bytes"] == 10 * per_slot
    # the runner's own VRAM watcher shrinks the cache: ps reads the runner again
    table = json.loads(sizes.read_text())
    table["a:latest"]["slots"] = 2
    sizes.write_text(json.dumps(table))
    [watched] = httpx.get(f"{srv.url}/api/ps").json()["models"]
    assert watched["size_vram"] == before["size_vram"] - 2 * per_slot
