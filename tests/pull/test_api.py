"""/api/pull and /api/push on the real server, driven by the official `ollama` client and by
the `freetoken` CLI, against the real registry; all on loopback."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import pytest

from freetoken.cli.client import Client
from freetoken.cli.main import main
from freetoken.pull import pull_model
from freetoken.store import Store
from tests.pull.conftest import make_cfg, publish
from tests.pull.harness import ThreadRegistry
from tests.pull.test_pull import same_files
from tests.server.harness import LiveServer


@pytest.fixture(scope="module")
def registry(tmp_path_factory, source) -> Iterator[ThreadRegistry]:
    with ThreadRegistry(tmp_path_factory.mktemp("registry")) as reg:
        publish(source, make_cfg(tmp_path_factory.mktemp("unused"), reg.url), "tiny", "wide")
        yield reg


@pytest.fixture(scope="module")
def server(tmp_path_factory, registry) -> Iterator[LiveServer]:
    with LiveServer(make_cfg(tmp_path_factory.mktemp("models"), registry.url)) as srv:
        yield srv


@pytest.fixture
def client(server) -> ollama.Client:
    return ollama.Client(host=server.url)


def test_ollama_client_pull(client, server, source):
    r = client.pull("wide")
    assert r.status == "success"
    assert "wide:latest" in [m.model for m in client.list().models]
    same_files(source, server.services.store, "wide")


def test_ollama_client_pull_streams_progress(client, server):
    events = list(client.pull("tiny", stream=True))
    statuses = [e.status for e in events]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert "verifying sha256 digest" in statuses and "writing manifest" in statuses
    bars = [e for e in events if e.digest]
    assert bars and all(e.status == f"pulling {e.digest[7:19]}" for e in bars)
    assert all(e.completed == e.total for e in bars if e is bars[-1])


def test_ollama_client_push(client, server, registry, tmp_path, source):
    client.pull("tiny")
    client.copy("tiny", "team/tiny:v2")
    events = list(client.push("team/tiny:v2", stream=True))
    statuses = [e.status for e in events]
    assert statuses[0] == "retrieving manifest" and statuses[-2:] == ["pushing manifest", "success"]
    assert all(e.status.startswith("pushing ") for e in events if e.digest)
    assert (registry.root / "manifests/team/tiny/v2").is_file()
    back = Store(tmp_path / "back")
    pull_model(back, "team/tiny:v2", cfg=make_cfg(tmp_path / "back", registry.url))
    fa = source.runner_files(source.resolve("tiny"))
    fb = back.runner_files(back.resolve("team/tiny:v2"))
    assert {k: Path(v).read_bytes() for k, v in fa.items()} == {
        k: Path(v).read_bytes() for k, v in fb.items()
    }


def test_unknown_model(client, server, registry):
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("nosuch")
    assert e.value.error == "pull model manifest: file does not exist"
    assert e.value.status_code == 404
    # Streaming: the error is the last line, after the first status.
    with httpx.stream("POST", server.url + "/api/pull", json={"model": "nosuch"}) as r:
        lines = [json.loads(x) for x in r.iter_lines() if x]
    assert r.status_code == 200
    assert lines == [
        {"status": "pulling manifest", "registry": registry.url},
        {"error": "pull model manifest: file does not exist"},
    ]


def test_request_errors(server):
    http = httpx.Client(base_url=server.url)
    r = http.post("/api/pull", json={"model": "a/b/c/d"})
    assert r.status_code == 400 and "invalid model name" in r.json()["error"]
    r = http.post("/api/push", json={"model": "not-here"})
    assert r.status_code == 404 and r.json()["error"] == "model 'not-here' not found"
    r = http.post("/api/pull", json={})
    assert r.status_code == 400 and r.json()["error"] == "model is required"
    # Older clients send `name`; stream:false answers with the last object.
    r = http.post("/api/pull", json={"name": "tiny", "stream": False})
    assert r.status_code == 200 and r.json() == {"status": "success"}


def test_cli_pull_and_push(server, registry, capsys):
    cli = Client(server.url)
    assert main(["pull", "wide"], client=cli) == 0
    err = capsys.readouterr().err
    assert f"pulling manifest ({registry.url})" in err and "success" in err
    assert main(["cp", "wide", "team/wide"], client=cli) == 0
    assert main(["push", "team/wide"], client=cli) == 0
    err = capsys.readouterr().err
    assert "pushing manifest" in err and "success" in err
    assert (registry.root / "manifests/team/wide/latest").is_file()


def test_a_request_names_its_registry(server, registry, tmp_path):
    """The CLI sends its own FREETOKEN_REGISTRY as `registry`; the server uses it instead of
    its own, so the pull goes where the user's shell says."""
    with ThreadRegistry(tmp_path / "other") as other:
        http = httpx.Client(base_url=server.url)
        r = http.post("/api/pull", json={"model": "tiny", "registry": other.url, "stream": False})
        assert r.status_code == 404 and "file does not exist" in r.json()["error"]
        with http.stream("POST", "/api/pull", json={"model": "tiny", "registry": other.url}) as r:
            first = json.loads(next(r.iter_lines()))
        assert first == {"status": "pulling manifest", "registry": other.url}
    r = http.post("/api/pull", json={"model": "tiny", "registry": "not a host"})
    assert r.status_code == 400 and r.json()["error"].startswith("registry: expected host")
