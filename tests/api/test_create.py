"""/api/create with files a client on this machine offers in place, and the claims uploads
take until their create: a real server of its own (its store is checked blob by blob)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from freetoken.store import Store
from tests.server.harness import LiveServer, make_config, tiny_model_dir


@pytest.fixture(scope="module")
def own(tmp_path_factory) -> Iterator[tuple[LiveServer, httpx.Client]]:
    with (
        LiveServer(make_config(tmp_path_factory.mktemp("models"))) as srv,
        httpx.Client(base_url=srv.url, timeout=120) as http,
    ):
        yield srv, http


def in_place(directory: Path) -> dict[str, dict]:
    out = {}
    for p in sorted(directory.iterdir()):
        st = p.stat()
        out[p.name] = {"path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return out


def test_local_files_are_converted_in_place(own):
    srv, http = own
    body = {"model": "here", "local_files": in_place(tiny_model_dir()), "stream": False}
    r = http.post("/api/create", json=body)
    assert r.status_code == 200 and r.json() == {"status": "success"}
    store: Store = srv.services.store
    view = store.resolve("here")
    assert "ftw.json" in view.files
    assert store.blobs.digests() <= view.manifest.digests()  # no source blob came in


def test_files_the_server_sees_otherwise_answer_412(own):
    _, http = own
    files = in_place(tiny_model_dir())
    files["model.safetensors"]["mtime_ns"] += 1
    r = http.post("/api/create", json={"model": "x", "local_files": files})
    assert r.status_code == 412 and "another file" in r.json()["error"]
    r = http.post("/api/create", json={"model": "x", "local_files": {"a": {"path": "/a"}}})
    assert r.status_code == 400 and "local_files" in r.json()["error"]


def test_uploads_and_checks_claim_a_blob_until_its_create(own):
    srv, http = own
    store: Store = srv.services.store
    data = b"a source file"
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    assert http.head(f"/api/blobs/{digest}").status_code == 404
    assert digest not in store.referenced()
    assert http.post(f"/api/blobs/{digest}", content=data).status_code == 201
    assert http.head(f"/api/blobs/{digest}").status_code == 200
    assert store.collect([digest]) == []  # held for the creates still to come
    store.release([digest, digest])
    assert store.collect([digest]) == [digest]


def test_only_clients_on_this_machine_may_name_files_in_place(tmp_path):
    from tests.server.harness import local_client

    body = {"model": "x", "local_files": in_place(tiny_model_dir())}
    with local_client(make_config(tmp_path), client=("192.0.2.7", 50000)) as remote:
        r = remote.post("/api/create", json=body)
    assert r.status_code == 412 and "only for clients on this machine" in r.json()["error"]
