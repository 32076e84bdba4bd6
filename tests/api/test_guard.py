"""The request guard: bounded bodies, and errors in the API's own shape for whatever escapes."""

from __future__ import annotations

import hashlib

import pytest
from starlette.testclient import TestClient

from freetoken.api.errors import JSONBody
from freetoken.api.guard import RequestGuard
from tests.server.harness import LOCAL_URL, local_client, make_config


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    cfg = make_config(tmp_path_factory.mktemp("models"), FREETOKEN_MAX_REQUEST_SIZE="1KiB")
    with local_client(cfg) as client:
        yield client


def _shape(path, r):
    body = r.json()
    if path.startswith("/v1/messages"):
        return body["type"] == "error" and body["error"]["type"] == "request_too_large"
    if path.startswith("/v1/"):
        return body["error"]["type"] == "api_error" and "message" in body["error"]
    return set(body) == {"error"}


@pytest.mark.parametrize("path", ["/api/chat", "/v1/chat/completions", "/v1/messages"])
def test_a_body_past_the_limit_is_413_in_the_apis_shape(small, path):
    big = b'{"model": "' + b"x" * 2000 + b'"}'
    r = small.post(path, content=big)
    assert r.status_code == 413 and _shape(path, r), r.text
    # sent without a length, it is cut off as it grows
    r = small.post(path, content=iter([big[:600], big[600:]]))
    assert r.status_code == 413 and _shape(path, r), r.text


def test_blob_uploads_are_not_bounded(small):
    data = b"w" * 4096
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    assert small.post(f"/api/blobs/{digest}", content=data).status_code == 201


async def _explode(scope, receive, send):
    raise RuntimeError("\ud800 boom")


@pytest.mark.parametrize(
    "path, want",
    [
        ("/api/chat", {"error": "? boom"}),
        ("/v1/chat/completions", {"message": "? boom", "type": "api_error"}),
        ("/v1/messages", {"type": "api_error", "message": "? boom"}),
    ],
)
def test_an_escaping_error_is_json_in_the_apis_shape(path, want):
    client = TestClient(RequestGuard(_explode, max_body=1 << 20), base_url=LOCAL_URL)
    r = client.post(path, content=b"{}")
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    body = r.json()
    got = body if path.startswith("/api") else body["error"]
    assert {k: got[k] for k in want} == want


def test_json_body_renders_lone_surrogates():
    assert JSONBody({"error": "a\udc80b"}).body == b'{"error":"a?b"}'
