"""Errors as the client reads them: a full disk is the same 507 on every path that writes
(issue 22: it was a 507 on pull but a 500 on create, blob upload and copy)."""

from __future__ import annotations

import errno
import hashlib
import os

import pytest

from freetoken.api.errors import DISK_FULL_MESSAGE
from freetoken.store import Store
from freetoken.store import blobs as blob_files
from freetoken.store import manifest as mf
from tests.server.harness import add_model, local_client, make_config


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    add_model(Store(root), "tiny")
    with local_client(make_config(root)) as c:
        yield c


@pytest.fixture
def full_disk(monkeypatch):
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(blob_files.BlobWriter, "write", no_space)
    monkeypatch.setattr(mf, "write", no_space)


def _full(r) -> bool:
    return r.status_code == 507 and r.json() == {"error": DISK_FULL_MESSAGE}


def test_blob_upload(client, full_disk):
    data = b"weights"
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    assert _full(client.post(f"/api/blobs/{digest}", content=data))


def test_create(client, full_disk):
    body = {"model": "child", "from": "tiny", "system": "new", "stream": False}
    assert _full(client.post("/api/create", json=body))
    # streamed, it fails before its first line: the same status and body
    assert _full(client.post("/api/create", json={**body, "stream": True}))
    assert {m["name"] for m in client.get("/api/tags").json()["models"]} == {"tiny:latest"}


def test_copy(client, full_disk):
    assert _full(client.post("/api/copy", json={"source": "tiny", "destination": "other"}))
    names = {m["name"] for m in client.get("/api/tags").json()["models"]}
    assert names == {"tiny:latest"}
