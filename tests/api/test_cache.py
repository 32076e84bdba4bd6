"""The expert-cache endpoints and `freetoken cache` against the real server and runner."""

from __future__ import annotations

import httpx
import pytest

from freetoken.cli.client import Client
from freetoken.cli.main import main
from freetoken.store import CreateSpec, Store
from tests.server.harness import LiveServer, make_config


@pytest.fixture(scope="module")
def cache_server(tiny_model, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("FREETOKEN_EXPERT_SLOTS", "12")  # the runner's pool: 12 of the 16 experts
    root = tmp_path_factory.mktemp("cache-models")
    for _ in Store(root).plan_create(CreateSpec(name="moe", from_=str(tiny_model[0]))).run():
        pass
    with LiveServer(make_config(root)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        yield srv, http
    mp.undo()


def test_cache_listing_resize_and_errors(cache_server):
    srv, http = cache_server
    assert (
        http.post(
            "/api/generate",
            json={"model": "moe", "prompt": "hi", "stream": False, "options": {"num_predict": 4}},
        ).status_code
        == 200
    )
    [m] = http.get("/api/cache").json()["models"]
    assert m["name"] == "moe:latest" and m["cache"]["slots"] == 12 and m["policy"] == "adaptive"
    # the bound's inputs: the bandwidths the split started from and one expert's bytes
    assert m["b_p_gbps"] > 0 and m["b_h_gbps"] > 0 and m["expert_bytes"] > 0
    assert m["fetch_ms_per_expert"] is None  # no GPU kernel fetches on a CPU
    [before] = http.get("/api/ps").json()["models"]
    assert (
        m["placement"] in ("cache", "layers") and m["books"] == "host"
    )  # no device-kept books on a CPU
    # the batch the placements were last compared at: none decided in four tokens
    assert m["placement_batch"] == 0 and m["placement_by_batch"] == {}
    r = http.post("/api/cache/resize", json={"model": "moe", "slots": 8})
    assert r.status_code == 200 and r.json()["slots"] == 8
    assert http.get("/api/cache").json()["models"][0]["cache"]["slots"] == 8
    # on a CPU the cache is a host-memory pool: the model's size shrinks with it
    [after] = http.get("/api/ps").json()["models"]
    freed = before["expert_cache_bytes"] // 3  # 4 of 12 slots
    assert after["expert_cache_bytes"] == before["expert_cache_bytes"] - freed
    assert after["size"] == before["size"] - freed and after["size_vram"] == 0
    r = http.post("/api/cache/resize", json={"model": "moe", "slots": 2})
    assert r.status_code == 400 and "below the floor" in r.json()["error"]
    assert http.post("/api/cache/resize", json={"model": "nope", "slots": 8}).status_code == 404
    assert http.post("/api/cache/resize", json={"model": "moe"}).status_code == 400
    [ps] = http.get("/api/ps").json()["models"]
    assert ps["kv_cache_bytes"] > 0 and ps["expert_cache_bytes"] > 0


def test_cli_cache_shows_and_resizes(cache_server, capsys):
    srv, http = cache_server
    http.post("/api/generate", json={"model": "moe"})  # loaded
    client = Client(srv.url)
    assert main(["cache"], client=client) == 0
    out = capsys.readouterr().out
    assert "moe:latest" in out and "adaptive" in out
    assert main(["cache", "resize", "--slots", "10"], client=client) == 0
    assert "10 expert slots" in capsys.readouterr().out
    assert main(["cache", "resize", "moe", "--slots", "1"], client=client) == 1
    assert "below the floor" in capsys.readouterr().err
